"""What the fused CPU forward is worth per model family: decode on the fused kernels against transformers' forward
over the paged bridge (the path of every family the fused forward does not take), with HF `generate` as the
baseline, same seeded weights, same prompts, greedy, in one run.

Shapes are the real checkpoints' (random weights): Qwen3-0.6B, Gemma-3-270M and SmolLM2-135M. One stream reports the time per
decoded token (a 65-token run minus a 1-token run, so the prompt's prefill drops out); 16 streams report tokens
per second over the whole run. Tokens are checked against HF `generate`'s at one stream.

    python benchmarks/families.py                                   # both shapes, float32
    python benchmarks/families.py --shapes qwen3-0.6b --dtype bfloat16
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import time

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from paged_backend.engine import LLM, SamplingParams
from paged_backend.worker.fused_forward import SWITCH
from paged_backend.worker.models import byte_tokenizer

SHAPES = {
    "qwen3-0.6b": (Qwen3Config, Qwen3ForCausalLM, dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=4096)),
    "gemma3-270m": (Gemma3TextConfig, Gemma3ForCausalLM, dict(
        hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
        head_dim=256, vocab_size=262144, query_pre_attn_scalar=256, sliding_window=512, max_position_embeddings=32768)),
    "smollm2-135m": (LlamaConfig, LlamaForCausalLM, dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048)),
}  # fmt: skip
PROMPT_TOKENS, NEW_TOKENS = 32, 64


def build(shape: str, dtype: torch.dtype) -> torch.nn.Module:
    config_cls, model_cls, dims = SHAPES[shape]
    torch.manual_seed(0)
    return model_cls(config_cls(**dims)).to(dtype).eval()


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def engine_figures(model, prompts: list[list[int]], fused: bool) -> tuple[float, float, list[int]]:
    """(ms per decoded token at one stream, tok/s at len(prompts) streams, the one stream's tokens)."""
    os.environ[SWITCH] = "1" if fused else "0"
    llm = LLM(model, tokenizer=byte_tokenizer(), block_size=16, num_blocks=len(prompts) * 8 + 16)
    assert (llm.engine.runner.fused is not None) == fused, llm.engine.runner.unfused_reason

    def run(batch, new_tokens):
        return llm.generate(batch, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))

    run(prompts[:1], 4)  # warm-up: kernels built, weights packed
    one = min(timed(lambda: run(prompts[:1], NEW_TOKENS + 1)) - timed(lambda: run(prompts[:1], 1)) for _ in range(2))
    tokens = run(prompts[:1], NEW_TOKENS)[0].outputs[0].token_ids
    many = len(prompts) * NEW_TOKENS / timed(lambda: run(prompts, NEW_TOKENS))
    return 1e3 * one / NEW_TOKENS, many, list(tokens)  # the engine goes with this frame


def hf_figures(model, prompts: list[list[int]]) -> tuple[float, float, list[int]]:
    def run(batch, new_tokens):
        ids = torch.tensor(batch)
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)  # fmt: skip

    run(prompts[:1], 4)
    one = min(timed(lambda: run(prompts[:1], NEW_TOKENS + 1)) - timed(lambda: run(prompts[:1], 1)) for _ in range(2))
    tokens = run(prompts[:1], NEW_TOKENS)[0, PROMPT_TOKENS:].tolist()
    many = len(prompts) * NEW_TOKENS / timed(lambda: run(prompts, NEW_TOKENS))
    return 1e3 * one / NEW_TOKENS, many, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--streams", type=int, default=16)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"{args.dtype}, {torch.get_num_threads()} threads, {PROMPT_TOKENS}-token prompts, {NEW_TOKENS} new tokens, "
          f"greedy, EOS ignored")  # fmt: skip
    print(f"| shape | system | ms/token, 1 stream | tok/s, {args.streams} streams | vs HF generate (1 / {args.streams}) "
          f"| tokens = HF's |")  # fmt: skip
    print("|---|---|---:|---:|---:|---|")
    for shape in args.shapes.split(","):
        model = build(shape, dtype)
        rng = random.Random(0)
        vocab = model.config.vocab_size
        prompts = [[rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(args.streams)]
        hf = hf_figures(model, prompts)
        unfused = engine_figures(model, prompts, fused=False)
        gc.collect()  # one engine's packed weights at a time
        rows = [("HF generate", hf), ("transformers' forward, paged", unfused),
                ("fused CPU forward", engine_figures(model, prompts, fused=True))]  # fmt: skip
        for name, (one, many, tokens) in rows:
            print(f"| {shape} | {name} | {one:.1f} | {many:.1f} | {hf[0] / one:.2f}x / {many / hf[1]:.2f}x | "
                  f"{'yes' if tokens == hf[2] else 'no'} |")  # fmt: skip
        del model
        gc.collect()


if __name__ == "__main__":
    main()
