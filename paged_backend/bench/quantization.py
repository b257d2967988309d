"""Quantized weights and fp8 KV, side by side against fp32, in one run.

Weights (fp32, bf16, torchao int8 and int4 weight-only): weight bytes, output tokens per CPU-second of the
engine on the throughput workload and on one request decoding alone (batch 1, bound by reading weights), greedy agreement with fp32 on a fixed prompt set, and the mean KL divergence of the
next-token distributions from fp32's, teacher-forced on fp32's greedy continuations.
KV pool (fp32 weights; fp32, bf16, fp8 e4m3 / e5m2, with and without per-layer scales from the first step):
KV bytes per token, output tok/s, greedy agreement with the fp32 pool, and teacher-forced top-1 agreement
(prompt logprobs over fp32's continuations: one number per position, so less noisy than free-running greedy).

    paged-backend bench quantization     # or python benchmarks/quantization.py; ~10 minutes on one CPU thread
"""

from __future__ import annotations

import argparse
import copy
import random
import time
from collections.abc import Callable

import torch

from paged_backend.bench.arg_types import vocabulary
from paged_backend.bench.throughput import make_engine
from paged_backend.bench.workload import synthetic_workload
from paged_backend.engine import SamplingParams
from paged_backend.worker.models import tiny_model
from paged_backend.worker.quantization import quantize_in_place, weight_bytes

DECODE_TOKENS = 128  # one request alone: every step is a batch-1 decode, bound by reading the weights
MODEL = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1536)
WEIGHTS: dict[str, Callable[[torch.nn.Module], None]] = {
    "fp32": lambda model: None,
    "bf16": lambda model: model.to(torch.bfloat16),
    "int8 weight-only (torchao)": lambda model: quantize_in_place(model, "torchao", "int8_weight_only"),
    "int4 weight-only (torchao intx)": lambda model: quantize_in_place(model, "torchao", "int4_weight_only"),
}
KV_POOLS = {
    "fp32": dict(cache_dtype="float32"),
    "bf16": dict(cache_dtype="bfloat16"),
    "fp8 e4m3, scale 1": dict(cache_dtype="fp8_e4m3"),
    "fp8 e4m3, calculated scales": dict(cache_dtype="fp8_e4m3", calculate_kv_scales=True),
    "fp8 e5m2, scale 1": dict(cache_dtype="fp8_e5m2"),
    "fp8 e5m2, calculated scales": dict(cache_dtype="fp8_e5m2", calculate_kv_scales=True),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paged-backend bench quantization", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=24, help="throughput workload size")
    parser.add_argument("--num-prompts", type=int, default=16, help="fixed prompt set for agreement and KL")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per prompt in that set")
    parser.add_argument("--vocab-size", type=vocabulary, default=8000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2, help="throughput runs per row; the fastest is reported")
    parser.add_argument("--lm-head-scale", type=float, default=8.0,
                        help="multiply the random lm_head so next-token distributions are peaked like a trained "
                        "model's, not near-uniform (1 = as initialised); the run prints the entropy it gives")  # fmt: skip
    return parser


def greedy_tokens(model, prompts: list[list[int]], new_tokens: int, **engine_kwargs) -> tuple[list[list[int]], object]:
    """Greedy continuations through the paged engine, and the engine's KV pool."""
    llm, _ = make_engine(model, prompts, [new_tokens] * len(prompts), **engine_kwargs)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)], llm.engine.kv_cache


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    """(share of tokens before each sequence's first divergence, share of sequences identical)."""
    prefix = sum(
        next((i for i, (a, b) in enumerate(zip(t, r, strict=True)) if a != b), len(r))
        for t, r in zip(tokens, reference, strict=True)
    )
    return prefix / sum(map(len, reference)), sum(t == r for t, r in zip(tokens, reference, strict=True)) / len(
        reference
    )


@torch.inference_mode()
def next_token_logprobs(model, prompts: list[list[int]], continuations: list[list[int]]) -> list[torch.Tensor]:
    """Teacher-forced log-probabilities at each continuation position (HF forward, sdpa)."""
    model.set_attn_implementation("sdpa")
    rows = []
    for prompt, continuation in zip(prompts, continuations, strict=True):
        ids = torch.tensor([prompt + continuation])
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        rows.append(torch.log_softmax(logits, dim=-1))
    return rows


def engine_top1(model, prompts: list[list[int]], continuations: list[list[int]], **engine_kwargs) -> float:
    """Share of continuation positions where the engine's top-1 next token (prompt logprobs, teacher-forced on
    fp32's greedy continuation, so every position reads K/V back from the pool) is fp32's greedy token."""
    llm, _ = make_engine(model, prompts, [1] * len(prompts), **engine_kwargs)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    outputs = llm.generate([p + c for p, c in zip(prompts, continuations, strict=True)], params)
    hits = [
        out.prompt_logprobs[position][token] >= max(out.prompt_logprobs[position].values())
        for out, prompt, continuation in zip(outputs, prompts, continuations, strict=True)
        for position, token in enumerate(continuation, start=len(prompt))
    ]
    return sum(hits) / len(hits)


def top1(reference_tokens: list[list[int]], logprobs: list[torch.Tensor]) -> float:
    """Share of positions where the teacher-forced argmax is fp32's greedy token."""
    hits = [int(row.argmax()) == token for tokens, rows in zip(reference_tokens, logprobs, strict=True) for token, row in
            zip(tokens, rows, strict=True)]  # fmt: skip
    return sum(hits) / len(hits)


def best_rate(model, prompts, outputs, repeats: int, **engine_kwargs) -> float:
    """Output tokens per CPU-second of this process, best of `repeats` runs. On a shared box wall time mostly
    measures the neighbours; with one thread, CPU time is what the run itself cost."""
    best = 0.0
    for _ in range(repeats):
        # Doubled so the warm-up has two prompts even when one request is timed alone.
        llm, params = make_engine(copy.deepcopy(model), prompts * 2, outputs * 2, **engine_kwargs)
        started = time.process_time()
        llm.generate(prompts, params[: len(prompts)])
        best = max(best, sum(outputs) / (time.process_time() - started))
    return best


def mean_kl(reference: list[torch.Tensor], other: list[torch.Tensor]) -> float:
    """Mean over positions of KL(reference || other)."""
    kl = [torch.sum(r.exp() * (r - o), dim=-1) for r, o in zip(reference, other, strict=True)]
    return float(torch.cat(kl).mean())


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    prompts, outputs = synthetic_workload(args.num_requests, args.seed, args.vocab_size)
    rng = random.Random(args.seed + 1)
    fixed = [[rng.randrange(args.vocab_size) for _ in range(rng.randint(8, 64))] for _ in range(args.num_prompts)]
    base = tiny_model("llama", seed=args.seed, vocab_size=args.vocab_size, max_position_embeddings=2048, **MODEL)
    with torch.no_grad():
        base.lm_head.weight.mul_(args.lm_head_scale)
    print(
        f"model: llama {MODEL} vocab {args.vocab_size} = {sum(p.numel() for p in base.parameters()) / 1e6:.0f}M "
        f"params, lm_head x{args.lm_head_scale:g}, {args.threads} thread(s); torchao quantizes the decoder's linear layers (not embeddings, lm_head)"
    )
    print(f"throughput workload: {args.num_requests} requests, prompt tokens {sum(map(len, prompts))}, output "
          f"tokens {sum(outputs)}, EOS ignored; agreement/KL: {args.num_prompts} prompts x {args.new_tokens} "
          f"greedy tokens")  # fmt: skip

    print(
        "\nweights                           weight MiB  vs fp32  tok/CPU-s  vs fp32  b=1 decode  vs fp32  greedy prefix  "
        "identical seqs  top-1 (forced)  mean KL vs fp32"
    )
    reference_tokens = reference_logprobs = fp32_rate = None
    for name, convert in WEIGHTS.items():
        model = copy.deepcopy(base)
        convert(model)
        size = weight_bytes(model)
        rate = best_rate(model, prompts, outputs, args.repeats)
        decode = best_rate(model, fixed[:1], [DECODE_TOKENS], args.repeats)
        tokens, _ = greedy_tokens(copy.deepcopy(model), fixed, args.new_tokens)
        if reference_tokens is None:
            reference_tokens, fp32_rate, fp32_size, fp32_decode = tokens, rate, size, decode
            reference_logprobs = next_token_logprobs(model, fixed, tokens)
            entropy = float(torch.cat([-(r.exp() * r).sum(-1) for r in reference_logprobs]).mean())
        prefix, identical = agreement(tokens, reference_tokens)
        logprobs = next_token_logprobs(model, fixed, reference_tokens)
        kl, forced = mean_kl(reference_logprobs, logprobs), top1(reference_tokens, logprobs)
        print(f"{name:<33} {size / 2**20:10.1f}  {size / fp32_size:6.2f}x  {rate:9.1f}  {rate / fp32_rate:6.2f}x  "
              f"{decode:10.1f}  {decode / fp32_decode:6.2f}x  {100 * prefix:12.1f}%  {100 * identical:13.1f}%  {100 * forced:13.1f}%  {kl:15.2e}",
              flush=True)  # fmt: skip
    print(
        f"(fp32 next-token entropy on this set: {entropy:.2f} nats; uniform would be "
        f"{torch.log(torch.tensor(float(args.vocab_size))):.2f})"
    )

    print(
        "\nKV pool (fp32 weights)           KV bytes/token  vs fp32  tok/CPU-s  vs fp32  greedy prefix  "
        "identical seqs  top-1 (forced)"
    )
    reference_tokens = None
    for name, kv in KV_POOLS.items():
        rate = best_rate(base, prompts, outputs, args.repeats, **kv)
        tokens, pool = greedy_tokens(copy.deepcopy(base), fixed, args.new_tokens, **kv)
        per_token = pool.bytes_per_block / pool.block_size
        if reference_tokens is None:
            reference_tokens, fp32_rate, fp32_per_token = tokens, rate, per_token
        prefix, identical = agreement(tokens, reference_tokens)
        forced = engine_top1(copy.deepcopy(base), fixed, reference_tokens, **kv)
        print(f"{name:<33} {per_token:14.0f}  {per_token / fp32_per_token:6.2f}x  {rate:9.1f}  "
              f"{rate / fp32_rate:6.2f}x  {100 * prefix:12.1f}%  {100 * identical:13.1f}%  {100 * forced:13.1f}%",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
