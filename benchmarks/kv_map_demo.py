"""The KV map of docs/operations.md: a real engine run with parallel sampling (n=3) and prefix-cache hits on a tiny
Gemma-3-style model (one sliding-window layer, window 16, and one full-attention layer: two block groups).

    python benchmarks/kv_map_demo.py --output docs/kv_map.png
"""

from __future__ import annotations

import argparse

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from paged_backend.engine import LLM, SamplingParams
from paged_backend.worker.models import byte_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default="docs/kv_map.png")
    parser.add_argument("--steps", type=int, default=10, help="engine steps before the picture is taken")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=16,
                              layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    torch.manual_seed(0)
    llm = LLM(Gemma3ForCausalLM(config).eval(), tokenizer=byte_tokenizer(), num_blocks=112, block_size=4)
    system = "You are a helpful assistant. Answer briefly. "
    llm.generate([system + "Hi!"], SamplingParams(temperature=0, max_tokens=4))  # publishes the system prompt
    engine = llm.engine
    questions = ["What is paging?", "Why blocks?", "Who shares?"]
    for index, question in enumerate(questions):
        params = SamplingParams(n=3, temperature=1.0, seed=index, max_tokens=40, ignore_eos=True)
        engine.add_request(f"req{index}", system + question, params)
    for _ in range(args.steps):
        engine.step()
    drawing = llm.kv_map(args.output, title="3 requests x n=3 sharing a cached system prompt")
    stats = engine.stats()
    print(f"wrote {drawing.png} and {drawing.html}; prefix hit rate {stats.prefix_cache_hit_rate:.0%}")
    while engine.has_unfinished_requests():
        engine.step()


if __name__ == "__main__":
    main()
