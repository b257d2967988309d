"""Decode steps with the KV pool on 2 MiB pages against the same engine on 4 KiB pages, one run.

Two engines on the benchmark's Llama (134M, fp32), one with PAGED_BACKEND_KV_HUGE_PAGES=1 and one without (the
default), take turns decoding the same batch of long prompts (prefix caching off). --scatter shuffles each pool's
free blocks first, as a long-running server's churn leaves them, so a sequence's blocks lie all over the pool;
--num-blocks sizes the pool (default: just the workload).
Prints the median and best step time per round and engine.

    python benchmarks/kv_pages.py --scatter --num-blocks 3600     # a 4 GiB pool, blocks scattered
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

from paged_backend.bench.throughput import bench_model, make_engine
from paged_backend.core import huge_pages
from paged_backend.engine import SamplingParams


def scatter(llm, seed: int) -> None:
    """The pool's free blocks in random order."""
    pool = llm.engine.block_manager.pool
    free = [pool.free_queue.popleft() for _ in range(len(pool.free_queue))]
    random.Random(seed).shuffle(free)
    for block in free:
        pool.free_queue.append(block)


def decode_step_times(llm, prompts: list[list[int]], output_len: int) -> list[float]:
    """Seconds per engine step after the prefill step, for one batch of `prompts`."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"kv-pages-{time.monotonic_ns()}-{i}", prompt, params)
    engine.step()  # the prefill and the first token
    times = []
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=1900)
    parser.add_argument("--output-len", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks")
    parser.add_argument("--scatter", action="store_true", help="shuffle the pools' free blocks first")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not huge_pages.huge_pages_offered():
        raise SystemExit("this kernel's transparent huge pages are off: nothing to compare")
    model, description = bench_model(False, 32000, 0)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 32000) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    sizing = {"num_blocks": args.num_blocks} if args.num_blocks else {}
    engines = {}
    for pages in ("2 MiB", "4 KiB"):
        os.environ[huge_pages.SWITCH] = "1" if pages == "2 MiB" else "0"  # read when the pool is allocated
        engines[pages], _ = make_engine(model, prompts, [args.output_len] * args.batch, enable_prefix_caching=False,
                                        max_num_batched_tokens=args.batch * args.prompt_len, **sizing)  # fmt: skip
        if args.scatter:
            scatter(engines[pages], seed=1)
    del os.environ[huge_pages.SWITCH]
    pool_gib = engines["2 MiB"].engine.kv_cache.total_bytes / 2**30
    print(f"{description}, {args.threads} threads; batch {args.batch} x prompt {args.prompt_len}, "
          f"{args.output_len} tokens; KV pool {pool_gib:.2f} GiB{', blocks scattered' if args.scatter else ''}")
    medians = {pages: [] for pages in engines}
    for round_ in range(args.rounds):
        for pages, llm in engines.items():
            times = decode_step_times(llm, prompts, args.output_len)
            medians[pages].append(statistics.median(times))
            print(f"round {round_}, {pages} pages: median {medians[pages][-1] * 1e3:.1f} ms, "
                  f"best {min(times) * 1e3:.1f} ms per step")
    ratio = statistics.median(medians["4 KiB"]) / statistics.median(medians["2 MiB"])
    print(f"4 KiB / 2 MiB step time (median of the rounds' medians): {ratio:.3f}")


if __name__ == "__main__":
    main()
