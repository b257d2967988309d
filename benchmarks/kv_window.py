"""KV bytes one sequence holds over a long generation on a Gemma-3-style model, with and without windowed groups.

Gemma 3 interleaves five sliding-window layers with one full-attention layer (window 512 in Gemma-3-1B, 1024 in
the 4B-27B models; `--window`). With per-group
block tables (the default) the windowed groups free blocks that leave their window; with
`disable_hybrid_kv_cache_manager=True` every layer keeps every block (one group, as before). Both runs use
the same tiny seeded model (hidden 64, so it runs fast on a CPU) and the same KV memory budget, generate the
same greedy tokens (checked), and sample the bytes the sequence holds as it grows. A bookkeeping-only replay
through the same BlockManager extends the curve to 32k tokens without running the model.

    python benchmarks/kv_window.py --tokens 8192 --window 1024
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from paged_backend import BlockManager
from paged_backend.core.kv_budget import bytes_per_block
from paged_backend.core.kv_groups import kv_cache_groups, sliding_windows
from paged_backend.engine import LLM, SamplingParams
from paged_backend.worker.models import byte_tokenizer

WINDOW, LAYERS, BLOCK_SIZE = 1024, 6, 16
KV_HEADS, HEAD_DIM = 1, 16


def gemma3_style(seed: int = 0, window: int = WINDOW) -> Gemma3ForCausalLM:
    config = Gemma3TextConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        sliding_window=window,
        max_position_embeddings=40_000,
        bos_token_id=253,
        eos_token_id=254,
        pad_token_id=255,
    )  # the default layer_types: five sliding layers, then a full one
    torch.manual_seed(seed)
    return Gemma3ForCausalLM(config).eval()


def run_engine(tokens: int, hybrid: bool, budget: int, every: int, window: int) -> dict:
    llm = LLM(gemma3_style(window=window), tokenizer=byte_tokenizer(), block_size=BLOCK_SIZE, kv_cache_memory_bytes=budget,
              disable_hybrid_kv_cache_manager=not hybrid, enable_prefix_caching=False, device="cpu")  # fmt: skip
    engine, manager = llm.engine, llm.engine.block_manager
    per_block = engine.kv_cache.bytes_per_block
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    engine.add_request("long", None, params, prompt_token_ids=list(range(3, 19)))
    samples, started, peak = [], time.perf_counter(), 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        request = engine.requests.get("long")
        if request is None:
            break
        seq = request.seqs[0]
        held = sum(manager.num_blocks_held(seq.seq_id)) * per_block
        peak = max(peak, held)
        if seq.num_tokens % every == 0:
            samples.append((seq.num_tokens, held))
    elapsed = time.perf_counter() - started
    return dict(
        groups=len(engine.kv_cache.groups), per_block=per_block, samples=samples, peak=peak, seconds=elapsed,
        tokens=outputs[0].outputs[0].token_ids, pool_blocks=manager.num_blocks,
    )  # fmt: skip


def replay(tokens: int, hybrid: bool, window: int) -> int:
    """Peak bytes one sequence holds over `tokens` tokens, block bookkeeping only (the engine's calls in order)."""
    windows = sliding_windows(gemma3_style(window=window).config) if hybrid else (None,) * LAYERS
    groups = kv_cache_groups(windows)
    per_block = bytes_per_block(len(groups[0].layers), KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.float32)
    manager = BlockManager(LAYERS * (tokens // BLOCK_SIZE + 2) + 1, BLOCK_SIZE, enable_prefix_caching=False,
                           sliding_windows=[g.sliding_window for g in groups])  # fmt: skip
    manager.allocate("s", list(range(16)))
    manager.commit("s", 16)
    peak = 0
    for n in range(16, tokens):
        manager.append_slots("s", [0])
        peak = max(peak, sum(manager.num_blocks_held("s")) * per_block)
        manager.commit("s", n + 1)
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="tokens generated after a 16-token prompt")
    parser.add_argument("--replay-tokens", type=int, nargs="*", default=[8192, 32768])
    parser.add_argument("--window", type=int, default=WINDOW, help="sliding window of the five windowed layers")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    budget = 2 * LAYERS * (args.tokens + 64) * KV_HEADS * HEAD_DIM * 4 * 2  # room for twice the sequence, fp32
    runs = {
        name: run_engine(args.tokens, hybrid, budget, every=1024, window=args.window) for name, hybrid in (("off", False), ("on", True))
    }
    same = runs["on"]["tokens"] == runs["off"]["tokens"]
    print(f"Gemma-3-style: {LAYERS} layers (5 sliding, window {args.window}, 1 full), block {BLOCK_SIZE}, "
          f"KV budget {budget / 2**20:.1f} MiB, {args.tokens} generated tokens; greedy outputs identical: {same}")  # fmt: skip
    print("\n| tokens in sequence | KV held, one group (KiB) | KV held, windowed groups (KiB) | ratio |")
    print("|---|---|---|---|")
    for (n, off), (_, on) in zip(runs["off"]["samples"], runs["on"]["samples"], strict=True):
        print(f"| {n} | {off / 1024:.0f} | {on / 1024:.0f} | {off / on:.2f}x |")
    off, on = runs["off"], runs["on"]
    print(f"| peak | {off['peak'] / 1024:.0f} | {on['peak'] / 1024:.0f} | {off['peak'] / on['peak']:.2f}x |")
    print(f"\nengine: {off['groups']} group / {on['groups']} groups; decode {args.tokens / off['seconds']:.0f} vs "
          f"{args.tokens / on['seconds']:.0f} tok/s (one sequence; the box is shared)")  # fmt: skip
    print("\n| replay: tokens | KV held, one group (KiB) | KV held, windowed groups (KiB) | ratio |")
    print("|---|---|---|---|")
    for tokens in args.replay_tokens:
        off_bytes, on_bytes = replay(tokens, False, args.window), replay(tokens, True, args.window)
        print(f"| {tokens} | {off_bytes / 1024:.0f} | {on_bytes / 1024:.0f} | {off_bytes / on_bytes:.2f}x |")


if __name__ == "__main__":
    main()
