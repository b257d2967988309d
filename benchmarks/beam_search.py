"""Beam search in the engine (beams fork and share blocks) against beam search on top of `generate`, the way vLLM V1
runs it: every step each beam is a new one-token request with logprobs=2 x width, and the prefix cache serves
what it can of the beam's tokens. Same model, prompts and widths, in one run: time, and whether the two searches
found the same beams.

    python benchmarks/beam_search.py [--model default] [--prompts 8] [--width 4] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import os
import time

from paged_backend import LLM, SamplingParams


def on_generate(llm: LLM, prompts: list[list[int]], width: int, max_tokens: int) -> list[list[list[int]]]:
    """vLLM V1's `LLM.beam_search` over `LLM.generate` (no end token: ignore_eos): one generate per step for every
    prompt's beams, each beam a new one-token request; each prompt's beams, best first."""
    live = [[(list(prompt), 0.0)] for prompt in prompts]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=2 * width, ignore_eos=True)
    for _ in range(max_tokens):
        flat = [beam for beams in live for beam in beams]
        outputs = iter(llm.generate([{"prompt_token_ids": tokens} for tokens, _ in flat], params))
        for index, beams in enumerate(live):
            going = []
            for tokens, cumulative in beams:
                entry = next(outputs).outputs[0].logprobs[0]
                top = sorted(entry.items(), key=lambda item: item[1], reverse=True)[: 2 * width]
                going += [(tokens + [token], cumulative + float(value)) for token, value in top]
            live[index] = sorted(going, key=lambda beam: beam[1], reverse=True)[:width]
    return [[tokens[len(prompt) :] for tokens, _ in beams] for prompt, beams in zip(prompts, live, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="a model path or id; default: the default model")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    llm = LLM(None if args.model == "default" else args.model, dtype=args.dtype)
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer(f"Question {i}: write a short story about a cat and a lighthouse.").input_ids
               for i in range(args.prompts)]  # fmt: skip
    params = SamplingParams(n=args.width, use_beam_search=True, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], params)  # warm up
    started = time.perf_counter()
    native = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params)
    native_time = time.perf_counter() - started
    started = time.perf_counter()
    baseline = on_generate(llm, prompts, args.width, args.max_tokens)
    baseline_time = time.perf_counter() - started
    same = sum([c.token_ids for c in output.outputs] == beams for output, beams in zip(native, baseline, strict=True))
    best_agree = [len(os.path.commonprefix([output.outputs[0].token_ids, beams[0]]))
                  for output, beams in zip(native, baseline, strict=True)]  # fmt: skip
    tokens = args.prompts * args.width * args.max_tokens
    print(f"{args.prompts} prompts, width {args.width}, {args.max_tokens} tokens, block size "
          f"{llm.engine.block_manager.block_size}\n")  # fmt: skip
    print("| beam search | s | beam tok/s | speed-up |\n|---|---:|---:|---:|")
    print(f"| on generate (vLLM V1's way) | {baseline_time:.2f} | {tokens / baseline_time:.1f} | 1.00 |")
    print(f"| in the engine (forked beams) | {native_time:.2f} | {tokens / native_time:.1f} | "
          f"{baseline_time / native_time:.2f} |")  # fmt: skip
    print(f"\nsame beams in both: {same} of {args.prompts} prompts; the best beams agree on their first "
          f"{sorted(best_agree)} tokens (dtype {llm.engine.model.dtype})")


if __name__ == "__main__":
    main()
