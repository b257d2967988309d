"""KV memory: one contiguous max-length buffer per request vs the paged pool, on the same ragged workload.

Replays requests step by step (each running request decodes one token per step) under one fixed KV
budget. The contiguous baseline reserves `max_len` tokens per admitted request, as frameworks with a
static KV buffer do; the paged side uses the real BlockManager (blocks allocated on demand).

    python benchmarks/kv_memory.py --requests 1000 --budget-gib 4
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np

from paged_backend import BlockManager


@dataclass
class Request:
    prompt_len: int
    output_len: int


@dataclass
class Replay:
    name: str
    steps: int = 0
    peak_concurrent: int = 0
    reserved_token_steps: int = 0  # sum over steps of token slots reserved
    used_token_steps: int = 0  # sum over steps of token slots holding KV
    preemptions: int = 0

    @property
    def waste_pct(self) -> float:
        return 100.0 * (1 - self.used_token_steps / self.reserved_token_steps)


def make_workload(n: int, max_len: int, seed: int) -> list[Request]:
    """Long-tailed (log-normal) prompt and output lengths, as in chat traces."""
    rng = np.random.default_rng(seed)
    prompts = np.clip(rng.lognormal(5.3, 0.9, n), 4, max_len // 2).astype(int)
    outputs = np.clip(rng.lognormal(4.6, 1.0, n), 1, max_len - prompts).astype(int)
    return [Request(int(p), int(o)) for p, o in zip(prompts, outputs, strict=True)]


def replay_contiguous(workload: list[Request], budget_tokens: int, max_len: int) -> Replay:
    stats = Replay("contiguous (max_len per request)")
    waiting, running = list(range(len(workload))), {}
    while waiting or running:
        while waiting and (len(running) + 1) * max_len <= budget_tokens:
            i = waiting.pop(0)
            running[i] = workload[i].prompt_len
        stats.steps += 1
        stats.peak_concurrent = max(stats.peak_concurrent, len(running))
        stats.reserved_token_steps += len(running) * max_len
        stats.used_token_steps += sum(running.values())
        for i in list(running):
            running[i] += 1
            if running[i] >= workload[i].prompt_len + workload[i].output_len:
                del running[i]
    return stats


def replay_paged(workload: list[Request], budget_tokens: int, block_size: int) -> Replay:
    stats = Replay(f"paged (block {block_size})")
    bm = BlockManager(budget_tokens // block_size + 1, block_size, enable_prefix_caching=False, watermark=0.01)
    waiting, running = list(range(len(workload))), []
    generated = [0] * len(workload)
    while waiting or running:
        while waiting and bm.can_allocate([0] * (workload[waiting[0]].prompt_len + generated[waiting[0]])):
            i = waiting.pop(0)
            bm.allocate(i, [0] * (workload[i].prompt_len + generated[i]))
            running.append(i)
        stats.steps += 1
        stats.peak_concurrent = max(stats.peak_concurrent, len(running))
        s = bm.stats()
        stats.reserved_token_steps += s.used_blocks * block_size
        stats.used_token_steps += s.tokens_stored
        for i in list(running):
            if i not in running:
                continue  # preempted earlier in this step
            while not bm.can_append(i):  # recompute-preempt the newest, possibly i itself
                victim = running.pop()
                bm.free(victim)
                waiting.insert(0, victim)
                stats.preemptions += 1
                if victim == i:
                    break
            if i not in running:
                continue
            bm.append_slots(i, [0])
            generated[i] += 1
            if generated[i] >= workload[i].output_len:
                bm.free(i)
                running.remove(i)
    assert bm.num_free_blocks == bm.num_blocks - 1, "blocks leaked"
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--budget-gib", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    # Llama-3-8B KV geometry: 32 layers x 8 KV heads x 128 dims, K and V, bf16.
    parser.add_argument("--bytes-per-token", type=int, default=2 * 32 * 8 * 128 * 2)
    args = parser.parse_args()

    workload = make_workload(args.requests, args.max_len, args.seed)
    totals = np.array([r.prompt_len + r.output_len for r in workload])
    budget_tokens = int(args.budget_gib * 2**30) // args.bytes_per_token
    print(f"workload: {args.requests} requests, seed {args.seed}, max_len {args.max_len}")
    for name, values in (
        ("prompt", [r.prompt_len for r in workload]),
        ("output", [r.output_len for r in workload]),
        ("total", totals),
    ):
        p = np.percentile(values, [50, 90, 99, 100]).astype(int)
        print(f"  {name:6s} len: mean {np.mean(values):7.1f}  p50 {p[0]}  p90 {p[1]}  p99 {p[2]}  max {p[3]}")
    print(f"KV budget: {args.budget_gib} GiB = {budget_tokens} tokens at {args.bytes_per_token} B/token\n")

    contiguous = replay_contiguous(workload, budget_tokens, args.max_len)
    paged = replay_paged(workload, budget_tokens, args.block_size)
    gib = args.bytes_per_token / 2**30
    print("| layout | mean KV reserved (GiB) | mean KV used (GiB) | waste | peak concurrent requests | steps to finish | preemptions |")
    print("|---|---|---|---|---|---|---|")
    for r in (contiguous, paged):
        print(
            f"| {r.name} | {r.reserved_token_steps / r.steps * gib:.3f} | {r.used_token_steps / r.steps * gib:.3f} "
            f"| {r.waste_pct:.1f}% | {r.peak_concurrent} | {r.steps} | {r.preemptions} |"
        )
    print(
        f"\nratios paged/contiguous: peak concurrency {paged.peak_concurrent / contiguous.peak_concurrent:.1f}x, "
        f"steps {paged.steps / contiguous.steps:.2f}x, waste {paged.waste_pct:.1f}% vs {contiguous.waste_pct:.1f}%"
    )


if __name__ == "__main__":
    main()
