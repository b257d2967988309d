"""model.generate with transformers' DynamicCache vs PagedCache (sdpa and paged_backend attention).

Same seeded model, same prompts, same decoding settings; prints a markdown table of wall time, tokens/s
(returned new tokens per second) and peak KV bytes, as ratios to DynamicCache, and whether tokens are identical.

    python benchmarks/hf_generate.py                       # small Llama on CPU, a few minutes
    python benchmarks/hf_generate.py --hidden 512 --layers 8 --repeats 3
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from paged_backend.hf import PagedCache

BLOCK_SIZE = 16
VARIANTS = ("dynamic", "paged+sdpa", "paged+paged_backend")


@dataclass
class Workload:
    name: str
    prompt_lens: list[int]
    generate_kwargs: dict


@dataclass
class Run:
    seconds: float
    new_tokens: int
    peak_kv_bytes: int
    sequences: torch.Tensor

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds


def build_model(args) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads // 2,
        max_position_embeddings=4096, pad_token_id=0, eos_token_id=None, initializer_range=0.2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None  # every row runs the full length: equal work on both sides
    return model


def left_padded(prompt_lens: list[int], vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    width = max(prompt_lens)
    ids = torch.zeros(len(prompt_lens), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(prompt_lens):
        ids[row, width - n :] = torch.randint(1, vocab, (n,), generator=g)
        mask[row, width - n :] = 1
    return {"input_ids": ids, "attention_mask": mask}


def dynamic_cache_bytes(cache: DynamicCache) -> int:
    """DynamicCache only grows during generate, so its size at the end is its peak."""
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def timed_generate(model, inputs, kwargs, cache) -> tuple[float, torch.Tensor]:
    torch.manual_seed(0)
    start = time.perf_counter()
    out = model.generate(**inputs, past_key_values=cache, **kwargs)
    seconds = time.perf_counter() - start
    return seconds, out if isinstance(out, torch.Tensor) else out.sequences


def run_once(model, workload: Workload, variant: str, args) -> Run:
    inputs = left_padded(workload.prompt_lens, args.vocab)
    model.set_attn_implementation("paged_backend" if variant == "paged+paged_backend" else "sdpa")
    if variant == "dynamic":
        cache = DynamicCache(config=model.config)
        seconds, sequences = timed_generate(model, inputs, workload.generate_kwargs, cache)
        peak = dynamic_cache_bytes(cache)
    else:
        cache = PagedCache(model, max_tokens=args.pool_tokens, block_size=BLOCK_SIZE)
        seconds, sequences = timed_generate(model, inputs, workload.generate_kwargs, cache)
        peak = cache.stats().peak_used_bytes
        cache.reset()
    new_tokens = sequences.shape[0] * (sequences.shape[1] - inputs["input_ids"].shape[1])
    return Run(seconds, new_tokens, peak, sequences)


def median_runs(model, workload: Workload, args) -> dict[str, Run]:
    """Variants take turns within each repeat, so load from other processes hits them alike."""
    runs: dict[str, list[Run]] = {variant: [] for variant in VARIANTS}
    for _ in range(args.repeats):
        for variant in VARIANTS:
            runs[variant].append(run_once(model, workload, variant, args))
    return {variant: sorted(rs, key=lambda r: r.seconds)[len(rs) // 2] for variant, rs in runs.items()}


def workloads(args) -> list[Workload]:
    new = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)
    return [
        Workload("batch 4, ragged prompts, greedy", [64, 128, 192, 256], dict(do_sample=False, **new)),
        Workload("1 prompt x 8 samples (n=8)", [512], dict(do_sample=True, num_return_sequences=8, **new)),
        Workload("1 prompt, beam search 8", [512], dict(num_beams=8, do_sample=False, **new)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pool-tokens", type=int, default=16_384, help="PagedCache budget (max_tokens)")
    args = parser.parse_args()
    model = build_model(args)
    print(f"Llama hidden={args.hidden} layers={args.layers} heads={args.heads} fp32, {torch.get_num_threads()} "
          f"threads, {args.new_tokens} new tokens, median of {args.repeats}\n")
    print("| workload | cache / attention | s | tok/s | x DynamicCache | peak KV MiB | x DynamicCache | same tokens |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for workload in workloads(args):
        results = median_runs(model, workload, args)
        base = results["dynamic"]
        for variant, result in results.items():
            same = "yes" if torch.equal(result.sequences, base.sequences) else "NO"
            print(f"| {workload.name} | {variant} | {result.seconds:.2f} | {result.tokens_per_s:.1f} | "
                  f"{result.tokens_per_s / base.tokens_per_s:.2f} | {result.peak_kv_bytes / 2**20:.2f} | "
                  f"{result.peak_kv_bytes / base.peak_kv_bytes:.2f} | {same} |")


if __name__ == "__main__":
    main()
