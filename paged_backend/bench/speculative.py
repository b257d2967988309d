"""Speculative decoding against plain decoding, in one run: per-token latency of one request (batch 1), output
tokens/s of 32 requests (batch 32), and acceptance, for n-gram prompt lookup and a draft model.

Workloads (random-weight models, so "acceptance" is whatever their greedy text gives):
- `cyclic`: prompts that repeat a short random span; the model's greedy output on them copies prompt spans
  often, so prompt lookup has something to find.
- `random`: random prompts, where lookup finds little and the truncated draft agrees with the target rarely.
- `agreeing`: random prompts, and a target whose layers past the draft's add only small updates (their o_proj and
  down_proj weights scaled by `--upper-scale`), so the truncated draft predicts most of its tokens: what a
  well-matched draft gives, which a random-weight model cannot give otherwise.
Drafts: the target's first `--draft-layers` decoder layers (a truncated-layer copy of its weights), and the
target itself as draft (every draft accepted: the ceiling of acceptance, at a full-size draft's cost).
Greedy tokens of every speculative row are checked identical to plain decoding's.

    python benchmarks/speculative.py          # ~15 minutes on one CPU thread
"""

from __future__ import annotations

import argparse
import copy
import random
import time

import torch

from paged_backend.engine import LLM, SamplingParams
from paged_backend.worker.models import byte_tokenizer, tiny_model

MODEL = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1536)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--draft-layers", type=int, default=2, help="decoder layers kept in the truncated draft")
    parser.add_argument(
        "--upper-scale",
        type=float,
        default=0.03,
        help="`agreeing`: scale of the residual updates of the layers past the draft's",
    )
    parser.add_argument("--new-tokens", type=int, default=96, help="tokens per request")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--disable-by-batch-size", type=int, default=8, help="for the row that sets it")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed runs per cell, modes taking turns; the fastest is reported"
    )
    return parser


def target(kind: str, args) -> torch.nn.Module:
    model = tiny_model("llama", seed=args.seed, **MODEL)
    if kind == "agreeing":
        with torch.no_grad():
            for layer in model.model.layers[args.draft_layers :]:
                layer.self_attn.o_proj.weight.mul_(args.upper_scale)
                layer.mlp.down_proj.weight.mul_(args.upper_scale)
    return model


def prompts(kind: str, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    if kind == "cyclic":
        return [[rng.randrange(253) for _ in range(rng.randint(4, 12))] * 4 for _ in range(count)]
    return [[rng.randrange(253) for _ in range(rng.randint(16, 48))] for _ in range(count)]


def truncated(model, num_layers: int):
    """A copy of `model` with only its first `num_layers` decoder layers: a truncated-layer draft of it."""
    draft = copy.deepcopy(model)
    draft.model.layers = draft.model.layers[:num_layers]
    draft.config.num_hidden_layers = num_layers
    return draft


def timed(llm: LLM, batch: list[list[int]], new_tokens: int) -> tuple[float, list, dict]:
    """(seconds of one greedy generate of `batch`, its outputs, its speculation counters)."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    before = llm.engine.stats()
    started = time.perf_counter()
    outputs = [out.outputs[0].token_ids for out in llm.generate(batch, params)]
    elapsed = time.perf_counter() - started
    after = llm.engine.stats()
    counters = {
        "drafted": after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
        "accepted": after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens,
        "drafts": after.spec_decode_num_drafts - before.spec_decode_num_drafts,
    }
    return elapsed, outputs, counters


def fastest(engines: dict[str, LLM], batches: dict[int, list], new_tokens: int, repeats: int) -> dict:
    """{(mode, batch size): (fastest seconds, outputs, counters)}. Modes take turns within each repeat, so a slow
    spell of a shared machine slows every mode's run, not one mode's rows."""
    best: dict = {}
    for _ in range(repeats):
        for name, llm in engines.items():
            for size, batch in batches.items():
                result = timed(llm, batch, new_tokens)
                if (name, size) not in best or result[0] < best[name, size][0]:
                    best[name, size] = result
    return best


def acceptance(counters: dict) -> str:
    return f"{counters['accepted'] / counters['drafted']:.0%}" if counters["drafted"] else "-"


def modes(model, args) -> dict:
    k, off = args.k, args.disable_by_batch_size
    ngram = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3}
    draft = {"model": truncated(model, args.draft_layers), "num_speculative_tokens": k}
    return {
        "plain": None,
        f"n-gram (k={k}, lookup 1..3)": ngram,
        f"n-gram, disable_by_batch_size={off}": {**ngram, "disable_by_batch_size": off},
        f"draft: {args.draft_layers} of {MODEL['num_layers']} layers (k={k})": draft,
        f"draft, disable_by_batch_size={off}": {**draft, "disable_by_batch_size": off},
        f"draft = target (k={k}, acceptance ceiling)": {"model": model, "num_speculative_tokens": k},
    }


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"model: llama hidden {MODEL['hidden_size']}, {MODEL['num_layers']} layers, vocab 256, fp32; "
          f"{args.threads} thread(s); {args.new_tokens} greedy tokens per request")  # fmt: skip
    print("| workload | mode | batch 1 ms/token | vs plain | acceptance | tokens/draft | batch 32 tok/s | vs plain "
          "| acceptance |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for kind in ("cyclic", "random", "agreeing"):
        model = target(kind, args)
        batch = prompts("random" if kind == "agreeing" else kind, args.batch, args.seed)
        engines = {}
        for name, spec in modes(model, args).items():
            engines[name] = LLM(model, tokenizer=byte_tokenizer(), block_size=16, num_blocks=1024,
                                speculative_config=spec)  # fmt: skip
            engines[name].generate(batch[:1], SamplingParams(temperature=0, max_tokens=4))  # warm up
        best = fastest(engines, {1: batch[:1], args.batch: batch}, args.new_tokens, args.repeats)
        base_ms = 1000 * best["plain", 1][0] / args.new_tokens
        base_tps = args.batch * args.new_tokens / best["plain", args.batch][0]
        for name in engines:
            (one_time, one_out, one), (many_time, many_out, many) = best[name, 1], best[name, args.batch]
            assert (one_out, many_out) == (best["plain", 1][1], best["plain", args.batch][1]), (
                f"{name} changed greedy tokens on {kind}"
            )
            ms = 1000 * one_time / args.new_tokens
            tps = args.batch * args.new_tokens / many_time
            per_draft = f"{1 + one['accepted'] / one['drafts']:.2f}" if one["drafts"] else "-"
            print(f"| {kind} | {name} | {ms:.2f} | {base_ms / ms:.2f}x | {acceptance(one)} | {per_draft} | {tps:.0f} "
                  f"| {tps / base_tps:.2f}x | {acceptance(many)} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
