"""Offline throughput: HF static `generate`, HF continuous batching, and the paged-backend engine.

One model, one workload, three systems, one run, at each thread count asked for (`--threads 1,default`). The
synthetic workload (long-tailed prompt and output lengths, EOS ignored) runs on a random-weight Llama; `--model
default` (SmolLM2-135M-Instruct), a GGUF file or a checkpoint with `--dataset chat` runs real chat prompts that
end at the model's natural EOS (capped at `--max-tokens`) in every system, and checks that each system's greedy
tokens equal the engine's. Prints requests/s, output tokens/s, the ratios against the targets
(6x the best HF static batch, 3x the best HF continuous batching), the share of the engine's wall time spent
outside the model forward, and the engine's model FLOP/s against this machine's matmul peak measured in the run.

    paged-backend bench throughput --quick       # 32 requests, tiny model, a couple of minutes
    paged-backend bench throughput               # 200 requests, ~100M-parameter Llama (slow on CPU)
    paged-backend bench throughput --model default --dataset chat    # 96 chat prompts, SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import copy
import time
from dataclasses import dataclass

import torch

from paged_backend.bench.arg_types import count, counts, vocabulary, writable_file
from paged_backend.bench.chat_workload import CHAT_DATASET, chat_workload
from paged_backend.bench.flops import matmul_peak, model_flops
from paged_backend.bench.hf_baselines import check_exact_lengths, run_hf_cb, run_static
from paged_backend.bench.report import markdown_table, write_json, write_plot
from paged_backend.bench.workload import jsonl_workload, synthetic_workload
from paged_backend.engine import LLM, SamplingParams
from paged_backend.engine.args import EngineArgs, add_engine_arguments, parse_with_config
from paged_backend.engine.detokenizer import eos_token_ids
from paged_backend.errors import InvalidRequest
from paged_backend.ops import resolve_backend
from paged_backend.worker.default_model import served_name
from paged_backend.worker.models import byte_tokenizer, load_model, resolve_device, tiny_model

FULL_MODEL = dict(hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=12, intermediate_size=2048)
QUICK_MODEL = dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=1024)
# Engine flags this benchmark declares itself, with its own meaning: the workload's seed, every system's dtype,
# the engine's token budget, and the TP=1 against TP=N comparison.
OWN_ENGINE_FLAGS = frozenset({"seed", "dtype", "max_num_batched_tokens", "tensor_parallel_size"})
LOADED_ONCE = frozenset({"model", "tokenizer"})  # `benchmarked_model` loads them once, for every system
DEFAULT_MODEL = "default"  # `--model default`: what `load_model(None)` loads (without --model: the synthetic Llama)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(
        prog="paged-backend bench throughput", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="32 requests on a small model")
    parser.add_argument("--num-requests", type=count, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=counts, default="1",
                        help="comma list of torch thread counts, each a full comparison; 'default' = the machine's")  # fmt: skip
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="weights and activations of every system (bfloat16 uses the CPU's bf16 matmul units)")  # fmt: skip
    parser.add_argument("--vocab-size", type=vocabulary, default=32000)
    parser.add_argument("--static-batch-sizes", type=counts, default=None, help="comma list; default 4,8,16,32")
    parser.add_argument("--cb-max-batch-tokens", default="64,128,256,default", help="comma list for HF CB")
    parser.add_argument("--max-num-batched-tokens", type=count, default=512, help="paged-backend token budget")
    parser.add_argument("--skip", default="",
                        help="comma list of systems to skip: engine,engine-dense,static,hf-cb")  # fmt: skip
    parser.add_argument("--dataset", default=None,
                        help=f'"{CHAT_DATASET}" (built-in chat questions through the chat template), or a JSONL '
                             'workload: {"prompt": text or token ids, "max_tokens": n} per line')  # fmt: skip
    parser.add_argument("--max-tokens", type=count, default=256, help=f"each request's cap with --dataset {CHAT_DATASET}")
    parser.add_argument("--eos", choices=["natural", "ignore"], default=None,
                        help=f"natural: requests end at EOS or their cap; ignore: at their cap exactly "
                             f"(default: natural with --dataset {CHAT_DATASET}, else ignore)")  # fmt: skip
    parser.add_argument("--tensor-parallel-size", type=count, default=1,
                        help="also run the engine at TP=1 and TP=N and report the share of time in collectives")  # fmt: skip
    parser.add_argument("--output-json", type=writable_file, default="bench-throughput.json")
    parser.add_argument("--plot", type=writable_file, default="bench-throughput.png", help="PNG of the throughputs ('' for none)")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="run the engine once more under torch.profiler and print where its time goes",
    )
    add_engine_arguments(parser, skip=OWN_ENGINE_FLAGS)
    return parser


def make_engine(
    model, prompts, outputs, *, ignore_eos: bool = True, **engine_kwargs
) -> tuple[LLM, list[SamplingParams]]:
    """A warmed-up engine sized for the workload, and the workload's sampling params (greedy; `outputs` are exact
    lengths when `ignore_eos`, else caps).

    `engine_kwargs` go to `LLM` as they are (e.g. max_num_batched_tokens) and override the sizing defaults."""
    total_tokens = sum(len(p) + o for p, o in zip(prompts, outputs, strict=True))
    sizing = dict(tokenizer=byte_tokenizer(), block_size=16, num_blocks=total_tokens // 16 + len(prompts) + 64)
    llm = LLM(model, **{**sizing, **engine_kwargs})
    llm.generate(prompts[:2], [SamplingParams(temperature=0, max_tokens=2)] * 2)  # warm up (and build kernels)
    return llm, [SamplingParams(temperature=0, max_tokens=o, ignore_eos=ignore_eos) for o in outputs]


@dataclass
class EngineRun:
    elapsed: float
    forward_time: float
    steps: int
    preemptions: int
    tokens: list[list[int]]  # each request's output tokens


def run_engine(model, prompts, outputs, *, ignore_eos: bool = True, **engine_kwargs) -> EngineRun:
    """One timed `LLM.generate` over the workload; `engine_kwargs` are `LLM` keyword arguments."""
    llm, params = make_engine(model, prompts, outputs, ignore_eos=ignore_eos, **engine_kwargs)
    before = llm.engine.stats()
    started = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - started
    tokens = [list(r.outputs[0].token_ids) for r in results]
    if ignore_eos:
        check_exact_lengths("engine", tokens, outputs)
    after = llm.engine.stats()
    return EngineRun(elapsed, after.forward_time - before.forward_time, after.num_steps - before.num_steps,
                     after.num_preemptions, tokens)  # fmt: skip


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
    """(model, tokenizer, description) every system runs: `--model` (a directory, hub id or GGUF file, or
    `default` for the default model, with its tokenizer or `--tokenizer`), else the benchmark's Llama with the byte
    tokenizer; on `--device` (auto: the GPU where there is one), so that every system runs there."""
    if args.model is None:
        model, description = bench_model(args.quick, args.vocab_size, args.seed, dtype)
        return model.to(resolve_device(args.device or "auto")), byte_tokenizer(), description
    name = None if args.model == DEFAULT_MODEL else args.model
    model, tokenizer = load_model(name, tokenizer=args.tokenizer, dtype=dtype, device=args.device or "auto",
                                  trust_remote_code=bool(args.trust_remote_code))  # fmt: skip
    params = sum(p.numel() for p in model.parameters())
    return model, tokenizer, f"{served_name(name)} = {params / 1e6:.0f}M params, {model.dtype}"


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


def workload(args: argparse.Namespace, base, tokenizer) -> tuple[list[list[int]], list[int]]:
    """(prompt token ids, each request's output count) of `--dataset`, else of the synthetic workload."""
    if args.dataset == CHAT_DATASET:
        return chat_workload(tokenizer, args.num_requests or (32 if args.quick else None), args.seed, args.max_tokens)
    if args.dataset:
        return jsonl_workload(args.dataset, tokenizer, args.num_requests)
    vocab_size = base.config.get_text_config().vocab_size
    return synthetic_workload(args.num_requests or (32 if args.quick else 200), args.seed, vocab_size)


def stopping_ids(args: argparse.Namespace, base, tokenizer) -> frozenset[int]:
    """The EOS ids every system stops at (the engine's rule), or none when the output counts are exact."""
    natural = (args.eos or ("natural" if args.dataset == CHAT_DATASET else "ignore")) == "natural"
    if not natural:
        return frozenset()
    ids = frozenset(eos_token_ids(tokenizer, base.generation_config))
    if not ids:
        raise InvalidRequest("this model and tokenizer name no EOS token, so requests cannot end naturally; "
                             "pass --eos ignore")  # fmt: skip
    return ids


def main(argv: list[str] | None = None) -> dict:
    args = parse_with_config(build_parser(), argv)
    counts = thread_counts(args.threads)
    base, tokenizer, description = benchmarked_model(args, args.dtype)
    prompts, outputs = workload(args, base, tokenizer)
    eos_ids = stopping_ids(args, base, tokenizer)
    ending = f"natural EOS (ids {sorted(eos_ids)}), each capped" if eos_ids else "EOS ignored"
    print(f"workload: {len(prompts)} requests{f' from {args.dataset}' if args.dataset else f', seed {args.seed}'}, "
          f"prompt tokens {sum(map(len, prompts))} (max {max(map(len, prompts))}), "
          f"output tokens {sum(outputs)} (max {max(outputs)}), {ending}")  # fmt: skip
    kwargs = {**engine_kwargs(args), "tokenizer": tokenizer, "ignore_eos": not eos_ids}
    payloads = [compare(args, threads, base, description, prompts, outputs, eos_ids, kwargs) for threads in counts]
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


def differing_requests(reference: list[list[int]], tokens: list[list[int]]) -> list[dict]:
    """The requests whose tokens are not the reference's, each with the first output position that differs."""
    differing = []
    for index, (expected, got) in enumerate(zip(reference, tokens, strict=True)):
        if expected != got:
            pairs = zip(expected, got, strict=False)  # up to the shorter one
            at = next((k for k, (a, b) in enumerate(pairs) if a != b), min(len(expected), len(got)))
            differing.append({"request": index, "position": at})
    return differing


def compare(args, threads: int, base, description: str, prompts, outputs, eos_ids, kwargs: dict) -> dict:
    """Every system over the workload at `threads` torch threads (`eos_ids`: where requests end, none for exact
    output counts; `kwargs`: the engine's `make_engine` keyword arguments); returns this run's JSON payload.

    With natural EOS, each system's greedy tokens are checked against the engine's, and a difference is
    printed loudly and recorded (tok/s then compare different amounts of text)."""
    torch.set_num_threads(threads)
    sizes = args.static_batch_sizes or "4,8,16,32"  # on CPU, batches past 32 only get slower
    skip = set(filter(None, args.skip.split(",")))
    num_requests = len(prompts)
    print(f"\nmodel: {description}, {threads} threads; "
          f"engine attention backend: {resolve_backend(None, base.device)}")  # fmt: skip
    results: list[dict] = []
    reference: list[list[int]] | None = None  # the engine's tokens, when greedy tokens are compared

    def report(name: str, seconds: float, tokens: list[list[int]]) -> None:
        produced = sum(map(len, tokens))
        result = {"system": name, "elapsed_s": seconds, "requests_per_s": num_requests / seconds,
                  "output_tokens_per_s": produced / seconds, "output_tokens": produced}  # fmt: skip
        print(f"  {name:<46} {seconds:8.2f} s  {num_requests / seconds:6.2f} req/s  {produced / seconds:8.1f} tok/s"
              f"  ({produced} tokens)", flush=True)  # fmt: skip
        if reference is not None:
            result["token_mismatches"] = differing_requests(reference, tokens)
            if result["token_mismatches"]:
                first = result["token_mismatches"][0]
                print(f"  !! TOKEN MISMATCH: {name} differs from the engine's greedy tokens on "
                      f"{len(result['token_mismatches'])} of {num_requests} requests (first: request "
                      f"{first['request']} from output token {first['position']})", flush=True)  # fmt: skip
        results.append(result)

    # The engine runs first so a long baseline sweep that gets cut short still leaves its number.
    flops_report = {}
    if "engine" not in skip:
        run = run_engine(copy.deepcopy(base), prompts, outputs, **kwargs)
        report(f"paged-backend engine mbt={args.max_num_batched_tokens}", run.elapsed, run.tokens)
        reference = run.tokens if eos_ids else None
        print(f"  engine: {run.steps} steps, {run.preemptions} preemptions, "
              f"{100 * (1 - run.forward_time / run.elapsed):.1f}% of wall time outside the model forward "
              f"({run.forward_time:.2f} s forward of {run.elapsed:.2f} s)", flush=True)  # fmt: skip
        achieved = model_flops(base, prompts, list(map(len, run.tokens))) / run.elapsed
        peak = matmul_peak(base)
        flops_report = {
            "engine_flops_per_s": achieved,
            "matmul_peak_flops_per_s": peak,
            "share_of_peak": achieved / peak,
        }
        print(f"  engine: {achieved / 1e9:.1f} model GFLOP/s = {100 * achieved / peak:.0f}% of this machine's "
              f"matmul peak ({peak / 1e9:.1f} GFLOP/s, {threads} threads, {base.dtype}; target 70%)", flush=True)  # fmt: skip
        if args.profile:
            profile_engine(copy.deepcopy(base), prompts, outputs, **kwargs)
    if "engine-dense" not in skip:  # the same engine on MKL's dense weights: what prepacking gains
        dense = run_engine(copy.deepcopy(base), prompts, outputs, **{**kwargs, "prepack_weights": False})
        report(f"paged-backend engine mbt={args.max_num_batched_tokens}, dense weights", dense.elapsed, dense.tokens)
    tensor_parallel = None
    if args.tensor_parallel_size > 1:
        from paged_backend.bench.parallel import compare_tensor_parallel

        tensor_parallel = compare_tensor_parallel(
            base, prompts, outputs, args.tensor_parallel_size, run_engine, make_engine, **kwargs
        )
    run_static(base, prompts[:2], [2, 2], 2)  # warm up kernels once
    if "static" not in skip:
        for size in map(int, sizes.split(",")):
            report(f"HF generate static batch={size}", *run_static(base, prompts, outputs, size, eos_ids))
    if "hf-cb" not in skip:
        for value in args.cb_max_batch_tokens.split(","):
            mbt = None if value == "default" else int(value)
            report(f"HF generate_batch CB max_batch_tokens={value}",
                   *run_hf_cb(copy.deepcopy(base), prompts, outputs, mbt, eos_ids))  # fmt: skip
    speedups = {}
    if "engine" not in skip:
        ours = results[0]["output_tokens_per_s"]
        best = {
            "vs_best_hf_static": max((r["output_tokens_per_s"] for r in results
                                      if r["system"].startswith("HF generate static")), default=None),
            "vs_best_hf_continuous_batching": max((r["output_tokens_per_s"] for r in results
                                                   if "CB" in r["system"]), default=None),
        }  # fmt: skip
        for key, baseline in best.items():
            if baseline:
                speedups[key] = ours / baseline
                verdict = "met" if speedups[key] >= TARGETS[key] else f"missed by {TARGETS[key] - speedups[key]:.2f}x"
                print(f"speedup {key.replace('_', ' ')}: {speedups[key]:.2f}x (target {TARGETS[key]:g}x: {verdict})")
    print(markdown_table(["system", "seconds", "req/s", "output tok/s", "output tokens", "tokens = engine's"],
                         [[r["system"], f"{r['elapsed_s']:.2f}", f"{r['requests_per_s']:.2f}",
                           f"{r['output_tokens_per_s']:.1f}", str(r["output_tokens"]), agreement(r, num_requests)]
                          for r in results]))  # fmt: skip
    payload = {"model": description, "threads": threads, "num_requests": num_requests, "natural_eos": bool(eos_ids),
               "prompt_tokens": sum(map(len, prompts)),
               "output_tokens": results[0]["output_tokens"] if results else sum(outputs), "results": results,
               "speedup": speedups, **flops_report}  # fmt: skip
    if tensor_parallel:
        payload["tensor_parallel"] = tensor_parallel
    return payload


def agreement(result: dict, num_requests: int) -> str:
    """The table's cell: how many requests produced the engine's greedy tokens ('-' when not compared)."""
    if "token_mismatches" not in result:
        return "-"
    return f"{num_requests - len(result['token_mismatches'])}/{num_requests}"
