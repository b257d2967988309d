"""Speculative decoding against plain decoding, in one run: per-token latency of one request (batch 1), output
tokens/s of 32 requests (batch 32), and acceptance, for n-gram prompt lookup and a draft model.

Workloads (random-weight model, so "acceptance" is whatever its greedy text gives, nothing is tuned):
- `cyclic`: prompts that repeat a short random span; the model's greedy output on them copies prompt spans
  often, so prompt lookup has something to find.
- `random`: random prompts, where lookup finds little.
Drafts: the target's first `--draft-layers` decoder layers (a truncated-layer copy sharing its weights), and the
target itself as draft (every draft accepted: the ceiling of acceptance, at a full-size draft's cost).
Greedy tokens of every speculative row are checked identical to plain decoding's.

    python benchmarks/speculative.py          # ~2 minutes on one CPU thread
"""

from __future__ import annotations

import argparse
import copy
import random
import time

import torch

from paged_backend.engine import LLM, SamplingParams
from paged_backend.models import byte_tokenizer, tiny_model

MODEL = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1536)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--draft-layers", type=int, default=4, help="decoder layers kept in the truncated draft")
    parser.add_argument("--new-tokens", type=int, default=96, help="tokens per request")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--disable-by-batch-size", type=int, default=8, help="for the row that sets it")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per row; the fastest is reported")
    return parser


def prompts(kind: str, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    if kind == "cyclic":
        return [[rng.randrange(253) for _ in range(rng.randint(4, 12))] * 4 for _ in range(count)]
    return [[rng.randrange(253) for _ in range(rng.randint(16, 48))] for _ in range(count)]


def truncated(model, num_layers: int):
    draft = copy.deepcopy(model)
    draft.model.layers = draft.model.layers[:num_layers]
    draft.config.num_hidden_layers = num_layers
    return draft


def timed(model, spec, batch: list[list[int]], new_tokens: int, repeats: int) -> tuple[float, list, dict]:
    """(fastest seconds of `repeats` generates after a warm-up, greedy outputs, spec counters of one generate)."""
    llm = LLM(model, tokenizer=byte_tokenizer(), block_size=16, num_blocks=1024, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(batch[:1], SamplingParams(temperature=0, max_tokens=4))  # warm up
    elapsed = float("inf")
    for _ in range(repeats):
        before = llm.engine.stats()
        started = time.perf_counter()
        outputs = [out.outputs[0].token_ids for out in llm.generate(batch, params)]
        elapsed = min(elapsed, time.perf_counter() - started)
        after = llm.engine.stats()
    counters = {
        "drafted": after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
        "accepted": after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens,
        "drafts": after.spec_decode_num_drafts - before.spec_decode_num_drafts,
    }
    return elapsed, outputs, counters


def acceptance(counters: dict) -> str:
    return f"{counters['accepted'] / counters['drafted']:.0%}" if counters["drafted"] else "-"


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    model = tiny_model("llama", seed=args.seed, **MODEL)
    k = args.k
    modes = {
        "plain": None,
        f"n-gram (k={k}, lookup 1..3)": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3},
        f"n-gram, disable_by_batch_size={args.disable_by_batch_size}": {
            "method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3,
            "disable_by_batch_size": args.disable_by_batch_size},
        f"draft: {args.draft_layers} of {MODEL['num_layers']} layers (k={k})": {
            "model": truncated(model, args.draft_layers), "num_speculative_tokens": k},
        f"draft = target (k={k}, acceptance ceiling)": {"model": model, "num_speculative_tokens": k},
    }  # fmt: skip
    print(f"model: llama hidden {MODEL['hidden_size']}, {MODEL['num_layers']} layers, vocab 256, fp32; "
          f"{args.threads} thread(s); {args.new_tokens} greedy tokens per request")  # fmt: skip
    print("| workload | mode | batch 1 ms/token | vs plain | acceptance | tokens/draft | batch 32 tok/s | vs plain "
          "| acceptance |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for kind in ("cyclic", "random"):
        batch = prompts(kind, args.batch, args.seed)
        base = None
        for name, spec in modes.items():
            one_time, one_out, one = timed(model, spec, batch[:1], args.new_tokens, args.repeats)
            many_time, many_out, many = timed(model, spec, batch, args.new_tokens, args.repeats)
            ms = 1000 * one_time / args.new_tokens
            tps = args.batch * args.new_tokens / many_time
            if base is None:
                base = (ms, tps, one_out, many_out)
            assert (one_out, many_out) == base[2:], f"{name} changed greedy tokens on {kind}"
            per_draft = f"{1 + one['accepted'] / one['drafts']:.2f}" if one["drafts"] else "-"
            print(f"| {kind} | {name} | {ms:.2f} | {base[0] / ms:.2f}x | {acceptance(one)} | {per_draft} | {tps:.0f} "
                  f"| {tps / base[1]:.2f}x | {acceptance(many)} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
