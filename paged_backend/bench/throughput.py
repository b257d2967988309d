"""Offline throughput: HF static `generate`, HF continuous batching, and the paged-backend engine.

One model, one workload (long-tailed prompt and output lengths, EOS ignored), three systems, one run, at each
thread count asked for (`--threads 1,default`). Prints requests/s, output tokens/s, the ratios against the targets
(6x the best HF static batch, 3x the best HF continuous batching), the share of the engine's wall time spent
outside the model forward, and the engine's model FLOP/s against this machine's matmul peak measured in the run.

    paged-backend bench throughput --quick       # 32 requests, tiny model, a couple of minutes
    paged-backend bench throughput               # 200 requests, ~100M-parameter Llama (slow on CPU)
"""

from __future__ import annotations

import argparse
import copy
import time
from dataclasses import dataclass

import torch

from paged_backend.bench.report import markdown_table, write_json, write_plot
from paged_backend.bench.workload import jsonl_workload, synthetic_workload
from paged_backend.engine import LLM, SamplingParams
from paged_backend.engine.args import EngineArgs, add_engine_arguments, parse_with_config
from paged_backend.ops import resolve_backend
from paged_backend.worker.models import byte_tokenizer, load_model, tiny_model

FULL_MODEL = dict(hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=12, intermediate_size=2048)
QUICK_MODEL = dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=1024)
# Engine flags this benchmark declares itself, with its own meaning: the workload's seed, every system's dtype,
# the engine's token budget, and the TP=1 against TP=N comparison.
OWN_ENGINE_FLAGS = frozenset({"seed", "dtype", "max_num_batched_tokens", "tensor_parallel_size"})
LOADED_ONCE = frozenset({"model", "tokenizer"})  # `benchmarked_model` loads them once, for every system


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(
        prog="paged-backend bench throughput", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="32 requests on a small model")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", default="1",
                        help="comma list of torch thread counts, each a full comparison; 'default' = the machine's")  # fmt: skip
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="weights and activations of every system (bfloat16 uses the CPU's bf16 matmul units)")  # fmt: skip
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--static-batch-sizes", default=None, help="comma list; default 4,8,16,32")
    parser.add_argument("--cb-max-batch-tokens", default="64,128,256,default", help="comma list for HF CB")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="paged-backend token budget")
    parser.add_argument("--skip", default="",
                        help="comma list of systems to skip: engine,engine-dense,static,hf-cb")  # fmt: skip
    parser.add_argument("--dataset", default=None,
                        help='JSONL workload: {"prompt": text or token ids, "max_tokens": n} per line')  # fmt: skip
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="also run the engine at TP=1 and TP=N and report the share of time in collectives")  # fmt: skip
    parser.add_argument("--output-json", default="bench-throughput.json")
    parser.add_argument("--plot", default="bench-throughput.png", help="PNG of the throughputs ('' for none)")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="run the engine once more under torch.profiler and print where its time goes",
    )
    add_engine_arguments(parser, skip=OWN_ENGINE_FLAGS)
    return parser


@torch.inference_mode()
def run_static(model, prompts, outputs, batch_size: int) -> float:
    """HF generate over arrival-order batches, left padded; each batch runs to its longest output."""
    started = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        batch, wanted = prompts[first : first + batch_size], max(outputs[first : first + batch_size])
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=wanted,
            min_new_tokens=wanted,
            do_sample=False,
            pad_token_id=0,
        )
    return time.perf_counter() - started


def run_hf_cb(model, prompts, outputs, max_batch_tokens: int | None) -> float:
    """HF's own continuous batching: one manager, per-request max_new_tokens, EOS disabled."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    generation = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=max(outputs))
    cb_config = ContinuousBatchingConfig(max_batch_tokens=max_batch_tokens)
    started = time.perf_counter()
    manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=cb_config)
    manager.start()
    for i, (prompt, wanted) in enumerate(zip(prompts, outputs, strict=True)):
        manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=wanted, eos_token_id=-1)
    produced = 0
    for _ in prompts:
        result = manager.get_result(timeout=3600)
        produced += len(result.generated_tokens)
    manager.stop(block=True)
    elapsed = time.perf_counter() - started
    if produced != sum(outputs):
        raise RuntimeError(f"HF CB produced {produced} tokens, expected {sum(outputs)}")
    return elapsed


def make_engine(model, prompts, outputs, **engine_kwargs) -> tuple[LLM, list[SamplingParams]]:
    """A warmed-up engine sized for the workload, and the workload's sampling params (greedy, EOS ignored).

    `engine_kwargs` go to `LLM` as they are (e.g. max_num_batched_tokens) and override the sizing defaults."""
    total_tokens = sum(len(p) + o for p, o in zip(prompts, outputs, strict=True))
    sizing = dict(tokenizer=byte_tokenizer(), block_size=16, num_blocks=total_tokens // 16 + len(prompts) + 64)
    llm = LLM(model, **{**sizing, **engine_kwargs})
    llm.generate(prompts[:2], [SamplingParams(temperature=0, max_tokens=2)] * 2)  # warm up (and build kernels)
    return llm, [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in outputs]


@dataclass
class EngineRun:
    elapsed: float
    forward_time: float
    steps: int
    preemptions: int


def run_engine(model, prompts, outputs, **engine_kwargs) -> EngineRun:
    """One timed `LLM.generate` over the workload; `engine_kwargs` are `LLM` keyword arguments."""
    llm, params = make_engine(model, prompts, outputs, **engine_kwargs)
    before = llm.engine.stats()
    started = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - started
    produced = sum(len(r.outputs[0].token_ids) for r in results)
    if produced != sum(outputs):
        raise RuntimeError(f"engine produced {produced} tokens, expected {sum(outputs)}")
    after = llm.engine.stats()
    return EngineRun(elapsed, after.forward_time - before.forward_time, after.num_steps - before.num_steps,
                     after.num_preemptions)  # fmt: skip


LINEAR_OPS = ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise")  # dense and prepacked linear layers


def profile_engine(model, prompts, outputs, **engine_kwargs) -> None:
    """Where the engine's wall time goes: linear layers (aten::mm/addmm), paged attention (cache write +
    kernel, the bridge's profiler label), the rest of the forward, and everything outside the forward."""
    from torch.profiler import ProfilerActivity, profile

    from paged_backend.worker.attention import PROFILE_LABEL

    llm, params = make_engine(model, prompts, outputs, **engine_kwargs)
    before = llm.engine.stats()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        llm.generate(prompts, params)
        wall = time.perf_counter() - started
    forward = llm.engine.stats().forward_time - before.forward_time
    events = {e.key: e for e in prof.key_averages()}
    linear = sum(events[k].self_cpu_time_total for k in LINEAR_OPS if k in events) / 1e6
    attention = events[PROFILE_LABEL].cpu_time_total / 1e6 if PROFILE_LABEL in events else 0.0
    shares = [
        ("linear layers (aten::mm/addmm, oneDNN packed)", linear),
        ("paged attention + cache write", attention),
        ("rest of the forward (norms, rotary, activations, sampling glue)", forward - linear - attention),
        ("outside the forward (scheduling, packing, sampling)", wall - forward),
    ]
    print(f"engine profile (separate run under torch.profiler, {wall:.2f} s wall):")
    for name, seconds in shares:
        print(f"  {name:<66} {seconds:7.2f} s  {100 * seconds / wall:5.1f}%")


def bench_model(quick: bool, vocab_size: int, seed: int, dtype: str = "float32"):
    """The benchmark's Llama (small with --quick) with SDPA attention, and a line describing it."""
    shape = QUICK_MODEL if quick else FULL_MODEL
    model = tiny_model("llama", seed=seed, vocab_size=vocab_size, max_position_embeddings=2048,
                       dtype=getattr(torch, dtype), **shape)  # fmt: skip
    model.set_attn_implementation("sdpa")
    params = sum(p.numel() for p in model.parameters())
    return model, f"llama {shape} vocab {vocab_size} = {params / 1e6:.0f}M params, {dtype}"


def benchmarked_model(args: argparse.Namespace, dtype: str = "float32"):
    """(model, tokenizer, description) every system runs: `--model` (a directory or hub id, on the CPU, with its
    tokenizer or `--tokenizer`), else the benchmark's Llama with the byte tokenizer."""
    if args.model is None:
        model, description = bench_model(args.quick, args.vocab_size, args.seed, dtype)
        return model, byte_tokenizer(), description
    model, tokenizer = load_model(args.model, tokenizer=args.tokenizer, dtype=dtype, device="cpu")
    params = sum(p.numel() for p in model.parameters())
    return model, tokenizer, f"{args.model} = {params / 1e6:.0f}M params, {model.dtype}"


def model_flops(model, prompts: list[list[int]], outputs: list[int]) -> float:
    """Useful FLOPs of the workload: every decoder linear layer once per token, the LM head once per output token,
    and attention's two products over each token's context (no padding, no recomputation)."""
    config = model.config
    decoder = sum(m.weight.numel() for name, m in model.named_modules()
                  if isinstance(m, torch.nn.Linear) and "lm_head" not in name)  # fmt: skip
    head = model.get_output_embeddings().weight.numel()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_context_token = 4 * config.num_hidden_layers * config.num_attention_heads * head_dim  # QK^T and PV
    flops = 0.0
    for prompt, wanted in zip(prompts, outputs, strict=True):
        tokens = len(prompt) + wanted
        flops += 2 * decoder * tokens + 2 * head * wanted + per_context_token * tokens * (tokens + 1) / 2
    return flops


def matmul_peak(model, repeats: int = 20) -> float:
    """FLOP/s of this machine's best case for the model: one [256, hidden] x [hidden, intermediate] linear in the
    model's dtype at the current thread count, dense (MKL) or prepacked (oneDNN), whichever is faster (best of
    `repeats`)."""
    from paged_backend.worker.packed_linear import packable, packed_forward

    config = model.config
    x = torch.randn(256, config.hidden_size, dtype=model.dtype)
    layer = torch.nn.Linear(config.hidden_size, config.intermediate_size, bias=False, dtype=model.dtype)
    best = float("inf")
    for linear in (layer.forward, packed_forward(layer)) if packable(layer) else (layer.forward,):
        for _ in range(repeats + 3):
            started = time.perf_counter()
            with torch.no_grad():
                linear(x)
            best = min(best, time.perf_counter() - started)
    return 2 * x.shape[0] * config.hidden_size * config.intermediate_size / best


TARGETS = {"vs_best_hf_static": 6.0, "vs_best_hf_continuous_batching": 3.0}  # the throughput issue's


def engine_options(args: argparse.Namespace, own: frozenset[str]) -> dict:
    """The engine flags given, as `LLM` keyword arguments (the benchmark's `own` flags and the model aside)."""
    return EngineArgs.from_namespace(args, set(EngineArgs.model_fields) - own - LOADED_ONCE).engine_kwargs()


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The `LLM` keyword arguments the flags ask for."""
    return {**engine_options(args, OWN_ENGINE_FLAGS), "max_num_batched_tokens": args.max_num_batched_tokens}


def thread_counts(value: str) -> list[int]:
    default = torch.get_num_threads()  # the machine's default, before this benchmark sets any
    return [default if item.strip() == "default" else int(item) for item in value.split(",")]


def main(argv: list[str] | None = None) -> dict:
    args = parse_with_config(build_parser(), argv)
    counts = thread_counts(args.threads)
    base, tokenizer, description = benchmarked_model(args, args.dtype)
    if args.dataset:
        prompts, outputs = jsonl_workload(args.dataset, tokenizer, args.num_requests)
    else:
        vocab_size = base.config.get_text_config().vocab_size
        prompts, outputs = synthetic_workload(args.num_requests or (32 if args.quick else 200), args.seed, vocab_size)
    print(f"workload: {len(prompts)} requests{f' from {args.dataset}' if args.dataset else f', seed {args.seed}'}, "
          f"prompt tokens {sum(map(len, prompts))} (max {max(map(len, prompts))}), "
          f"output tokens {sum(outputs)} (max {max(outputs)}), EOS ignored")  # fmt: skip
    kwargs = {**engine_kwargs(args), "tokenizer": tokenizer}
    payloads = [compare(args, threads, base, description, prompts, outputs, kwargs) for threads in counts]
    payload = dict(payloads[0])
    if len(payloads) > 1:
        payload["by_threads"] = {str(threads): p for threads, p in zip(counts, payloads, strict=True)}
    write_json(args.output_json, payload)
    results = [
        {**r, "system": r["system"] + (f" ({p['threads']} threads)" if len(payloads) > 1 else "")}
        for p in payloads
        for r in p["results"]
    ]

    def figure(plt):
        fig, axis = plt.subplots(figsize=(8, 0.45 * len(results) + 1.5))
        axis.barh([r["system"] for r in results], [r["output_tokens_per_s"] for r in results],
                  color=["C2" if r["system"].startswith("paged") else "C0" for r in results])  # fmt: skip
        axis.invert_yaxis()
        axis.set(xlabel="output tokens/s", title=f"offline throughput, {len(prompts)} requests")
        axis.grid(alpha=0.3, axis="x")
        return fig

    write_plot(args.plot, figure)
    return payload


def compare(args, threads: int, base, description: str, prompts, outputs, kwargs: dict) -> dict:
    """Every system over the workload at `threads` torch threads (`kwargs`: the engine's `LLM` keyword
    arguments); returns this run's JSON payload."""
    torch.set_num_threads(threads)
    sizes = args.static_batch_sizes or "4,8,16,32"  # on CPU, batches past 32 only get slower
    skip = set(filter(None, args.skip.split(",")))
    num_requests, useful = len(prompts), sum(outputs)
    print(f"\nmodel: {description}, {threads} threads; "
          f"engine attention backend: {resolve_backend(None, torch.device('cpu'))}")  # fmt: skip
    rows: list[tuple[str, float]] = []

    def report(name: str, seconds: float) -> None:
        rows.append((name, seconds))
        print(f"  {name:<46} {seconds:8.2f} s  {num_requests / seconds:6.2f} req/s  {useful / seconds:8.1f} tok/s",
              flush=True)  # fmt: skip

    # The engine runs first so a long baseline sweep that gets cut short still leaves its number.
    flops_report = {}
    if "engine" not in skip:
        run = run_engine(copy.deepcopy(base), prompts, outputs, **kwargs)
        report(f"paged-backend engine mbt={args.max_num_batched_tokens}", run.elapsed)
        print(f"  engine: {run.steps} steps, {run.preemptions} preemptions, "
              f"{100 * (1 - run.forward_time / run.elapsed):.1f}% of wall time outside the model forward "
              f"({run.forward_time:.2f} s forward of {run.elapsed:.2f} s)", flush=True)  # fmt: skip
        achieved, peak = model_flops(base, prompts, outputs) / run.elapsed, matmul_peak(base)
        flops_report = {"engine_flops_per_s": achieved, "matmul_peak_flops_per_s": peak, "share_of_peak": achieved / peak}
        print(f"  engine: {achieved / 1e9:.1f} model GFLOP/s = {100 * achieved / peak:.0f}% of this machine's "
              f"matmul peak ({peak / 1e9:.1f} GFLOP/s, {threads} threads, {base.dtype}; target 70%)", flush=True)  # fmt: skip
        if args.profile:
            profile_engine(copy.deepcopy(base), prompts, outputs, **kwargs)
    if "engine-dense" not in skip:  # the same engine on MKL's dense weights: what prepacking gains
        dense = run_engine(copy.deepcopy(base), prompts, outputs, **{**kwargs, "prepack_weights": False})
        report(f"paged-backend engine mbt={args.max_num_batched_tokens}, dense weights", dense.elapsed)
    tensor_parallel = None
    if args.tensor_parallel_size > 1:
        from paged_backend.bench.parallel import compare_tensor_parallel

        tensor_parallel = compare_tensor_parallel(
            base, prompts, outputs, args.tensor_parallel_size, run_engine, make_engine, **kwargs
        )
    run_static(base, prompts[:2], [2, 2], 2)  # warm up kernels once
    if "static" not in skip:
        for size in map(int, sizes.split(",")):
            report(f"HF generate static batch={size}", run_static(base, prompts, outputs, size))
    if "hf-cb" not in skip:
        for value in args.cb_max_batch_tokens.split(","):
            mbt = None if value == "default" else int(value)
            seconds = run_hf_cb(copy.deepcopy(base), prompts, outputs, mbt)
            report(f"HF generate_batch CB max_batch_tokens={value}", seconds)
    speedups = {}
    if "engine" not in skip:
        ours = useful / run.elapsed
        best = {
            "vs_best_hf_static": max((useful / s for n, s in rows if n.startswith("HF generate static")), default=None),
            "vs_best_hf_continuous_batching": max((useful / s for n, s in rows if "CB" in n), default=None),
        }
        for key, baseline in best.items():
            if baseline:
                speedups[key] = ours / baseline
                verdict = "met" if speedups[key] >= TARGETS[key] else f"missed by {TARGETS[key] - speedups[key]:.2f}x"
                print(f"speedup {key.replace('_', ' ')}: {speedups[key]:.2f}x (target {TARGETS[key]:g}x: {verdict})")
    results = [{"system": name, "elapsed_s": seconds, "requests_per_s": num_requests / seconds,
                "output_tokens_per_s": useful / seconds} for name, seconds in rows]  # fmt: skip
    print(markdown_table(["system", "seconds", "req/s", "output tok/s"],
                         [[r["system"], f"{r['elapsed_s']:.2f}", f"{r['requests_per_s']:.2f}",
                           f"{r['output_tokens_per_s']:.1f}"] for r in results]))  # fmt: skip
    payload = {"model": description, "threads": threads, "num_requests": num_requests,
               "prompt_tokens": sum(map(len, prompts)), "output_tokens": useful, "results": results,
               "speedup": speedups, **flops_report}  # fmt: skip
    if tensor_parallel:
        payload["tensor_parallel"] = tensor_parallel
    return payload
