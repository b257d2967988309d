"""What asking for logprobs costs the engine: greedy throughput with no logprobs (the baseline) and with
logprobs=0, 5 and 20 (each token's Logprob with its rank and text, plus the top k), in one run, as ratios.

    python benchmarks/logprobs.py [--model default] [--requests 64] [--max-tokens 64] [--repeats 2]
"""

from __future__ import annotations

import argparse
import time

from paged_backend import LLM, SamplingParams

LEVELS = (None, 0, 5, 20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="a model path or id; default: the default model")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per level, alternating; best is kept")
    args = parser.parse_args()
    llm = LLM(None if args.model == "default" else args.model, max_num_seqs=args.requests)
    prompts = [f"Write a short story number {i} about a cat." for i in range(args.requests)]
    params = {level: SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=level)
              for level in LEVELS}  # fmt: skip
    for level in LEVELS:  # warm every path once
        llm.generate(prompts[:4], params[level])
    best = dict.fromkeys(LEVELS, float("inf"))
    for _ in range(args.repeats):
        for level in LEVELS:
            started = time.perf_counter()
            llm.generate(prompts, params[level])
            best[level] = min(best[level], time.perf_counter() - started)
    tokens = args.requests * args.max_tokens
    print("| logprobs | tok/s | x no logprobs |\n|---|---:|---:|")
    for level in LEVELS:
        print(f"| {'none' if level is None else level} | {tokens / best[level]:.1f} | {best[None] / best[level]:.2f} |")


if __name__ == "__main__":
    main()
