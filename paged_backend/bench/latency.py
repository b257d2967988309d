"""Batch-1 decode latency: the paged-backend engine against HF `generate`, one model, one run.

Each iteration generates --output-len tokens for --batch-size prompts of --input-len tokens (greedy, EOS
ignored); the table shows the iteration latency (mean and percentiles) and the time per output token.

    paged-backend bench latency --quick             # small model, a few seconds
    paged-backend bench latency --input-len 32 --output-len 128 --num-iters 10
"""

from __future__ import annotations

import argparse
import copy
import random
import time

import torch

from paged_backend.bench.arg_types import count, count_or_zero, vocabulary, writable_file
from paged_backend.bench.report import distribution_ms, markdown_table, write_json, write_plot
from paged_backend.bench.throughput import benchmarked_model, engine_options
from paged_backend.engine import LLM, SamplingParams
from paged_backend.engine.args import add_engine_arguments, parse_with_config
from paged_backend.worker.models import resolve_dtype

PERCENTILES = (50, 90, 99)
OWN_ENGINE_FLAGS = frozenset({"seed"})  # seeds the prompts and the benchmark's model


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(
        prog="paged-backend bench latency", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="the small model and 3 iterations")
    parser.add_argument("--input-len", type=count, default=32)
    parser.add_argument("--output-len", type=count, default=128)
    parser.add_argument("--batch-size", type=count, default=1)
    parser.add_argument("--num-iters-warmup", type=count_or_zero, default=1)
    parser.add_argument("--num-iters", type=count, default=None, help="default 10 (3 with --quick)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=count, default=1, help="torch threads (1 is stable on a shared box)")
    parser.add_argument("--vocab-size", type=vocabulary, default=32000)
    parser.add_argument("--skip", default="", help="comma list of systems to skip: engine,hf")
    parser.add_argument("--output-json", type=writable_file, default="bench-latency.json")
    parser.add_argument("--plot", type=writable_file, default="bench-latency.png", help="PNG of the latencies ('' for none)")
    add_engine_arguments(parser, skip=OWN_ENGINE_FLAGS)
    return parser


def time_iterations(run, warmup: int, iterations: int) -> list[float]:
    for _ in range(warmup):
        run()
    latencies = []
    for _ in range(iterations):
        started = time.perf_counter()
        run()
        latencies.append(time.perf_counter() - started)
    return latencies


def engine_runner(model, tokenizer, prompts: list[list[int]], output_len: int, **engine_kwargs):
    llm = LLM(model, **{"tokenizer": tokenizer, "block_size": 16, **engine_kwargs})
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)

    def run() -> None:
        outputs = llm.generate(prompts, [params] * len(prompts), use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)

    return run


def hf_runner(model, prompts: list[list[int]], output_len: int):
    ids = torch.tensor(prompts)

    @torch.inference_mode()
    def run() -> None:
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                             min_new_tokens=output_len, do_sample=False, pad_token_id=0)  # fmt: skip
        assert out.shape[1] == ids.shape[1] + output_len

    return run


def main(argv: list[str] | None = None) -> dict:
    args = parse_with_config(build_parser(), argv)
    torch.set_num_threads(args.threads)
    iterations = args.num_iters or (3 if args.quick else 10)
    skip = set(filter(None, args.skip.split(",")))
    # in the dtype the engine runs, so that HF generate is timed in the same one
    dtype = resolve_dtype(args.dtype or "auto", torch.device("cpu"))
    model, tokenizer, description = benchmarked_model(args, str(dtype).removeprefix("torch."))
    rng, vocab_size = random.Random(args.seed), model.config.get_text_config().vocab_size
    prompts = [[rng.randrange(vocab_size) for _ in range(args.input_len)] for _ in range(args.batch_size)]
    print(f"model: {description}; batch {args.batch_size}, input {args.input_len}, output {args.output_len} tokens, "
          f"{iterations} iterations after {args.num_iters_warmup} warm-up")  # fmt: skip
    systems = {}
    if "engine" not in skip:
        run = engine_runner(copy.deepcopy(model), tokenizer, prompts, args.output_len,
                            **engine_options(args, OWN_ENGINE_FLAGS))  # fmt: skip
        systems["paged-backend engine"] = time_iterations(run, args.num_iters_warmup, iterations)
    if "hf" not in skip:
        systems["HF generate"] = time_iterations(
            hf_runner(model, prompts, args.output_len), args.num_iters_warmup, iterations
        )
    results = {name: {**distribution_ms(values, PERCENTILES), "per_token_ms": 1000 * min(values) / args.output_len,
                      "iterations_s": values} for name, values in systems.items()}  # fmt: skip
    header = ["system", "mean (ms)", *(f"p{q} (ms)" for q in PERCENTILES), "ms / output token (best)"]
    rows = [[name, f"{r['mean']:.1f}", *(f"{r[f'p{q}']:.1f}" for q in PERCENTILES), f"{r['per_token_ms']:.2f}"]
            for name, r in results.items()]  # fmt: skip
    print(markdown_table(header, rows))
    if len(results) == 2:
        ours, theirs = results["paged-backend engine"]["mean"], results["HF generate"]["mean"]
        print(f"HF generate latency / engine latency: {theirs / ours:.2f}x (above 1: the engine is faster)")
    payload = {"model": description, "batch_size": args.batch_size, "input_len": args.input_len,
               "output_len": args.output_len, "results": results}  # fmt: skip
    write_json(args.output_json, payload)

    def figure(plt):
        fig, axis = plt.subplots(figsize=(6, 3.5))
        axis.boxplot([[v * 1000 for v in r["iterations_s"]] for r in results.values()], tick_labels=list(results))
        axis.set(
            ylabel="iteration latency (ms)",
            title=f"batch {args.batch_size}: {args.input_len} in, {args.output_len} out",
        )
        axis.grid(alpha=0.3)
        return fig

    write_plot(args.plot, figure)
    return payload
