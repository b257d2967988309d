"""Does `torch.compile` (inductor, dynamic shapes) of the model speed up the engine's steps on CPU?

The same greedy workload (32 requests, the quick throughput model) through one engine run eagerly and one whose
runner calls `torch.compile(model, dynamic=True)`; prints warm-up (compile) time, tok/s and whether the tokens
agree. The fused CPU attention kernel is called through ctypes, which dynamo cannot trace: every layer breaks the
graph there, which is what this measures.

    OMP_NUM_THREADS=1 python benchmarks/compile_step.py
"""

from __future__ import annotations

import random
import time

import torch

from paged_backend.bench.throughput import QUICK_MODEL
from paged_backend.engine import LLM, SamplingParams
from paged_backend.models import byte_tokenizer, tiny_model


def run(compiled: bool) -> tuple[float, float, list[list[int]]]:
    model = tiny_model("llama", seed=0, vocab_size=32000, max_position_embeddings=2048, **QUICK_MODEL)
    llm = LLM(model, tokenizer=byte_tokenizer(), device="cpu", max_num_batched_tokens=512)
    if compiled:
        llm.engine.runner.model = torch.compile(model, dynamic=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 30000) for _ in range(rng.randint(8, 120))] for _ in range(32)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(16, 128), ignore_eos=True) for _ in prompts]
    started = time.perf_counter()
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up / compile
    warm = time.perf_counter() - started
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - started
    tokens = [out.outputs[0].token_ids for out in outputs]
    return warm, sum(map(len, tokens)) / elapsed, tokens


def main() -> None:
    torch.set_num_threads(1)
    eager_warm, eager_rate, eager_tokens = run(compiled=False)
    compiled_warm, compiled_rate, compiled_tokens = run(compiled=True)
    print("| mode | warm-up s | output tok/s |")
    print("|---|---|---|")
    print(f"| eager | {eager_warm:.1f} | {eager_rate:.0f} |")
    print(f"| torch.compile(dynamic=True) | {compiled_warm:.1f} | {compiled_rate:.0f} |")
    print(f"compiled / eager: {compiled_rate / eager_rate:.2f}x; same tokens: {eager_tokens == compiled_tokens}")


if __name__ == "__main__":
    main()
