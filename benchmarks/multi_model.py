"""Two models behind one server: do their engines gain from stepping in threads of their own?

Two engines (two different tiny models, at two sizes, 1 torch thread each) each get the same 16 greedy
requests. Sequential: one thread steps engine A to completion, then engine B. Threaded: one thread per engine,
as `serve --model A --model B` runs them (each model's AsyncEngine owns a thread). torch releases the GIL inside
its kernels, so the threads overlap when the machine has a free core.

    python benchmarks/multi_model.py
"""

from __future__ import annotations

import threading
import time

import torch

from paged_backend.config import CacheConfig, EngineConfig
from paged_backend.engine import Engine, SamplingParams
from paged_backend.worker.models import EMBEDDED_SHAPE, byte_tokenizer, tiny_model

LARGER_SHAPE = dict(hidden_size=768, num_layers=4, num_heads=12, num_kv_heads=4, intermediate_size=3072)


def engine(arch: str, seed: int, shape: dict) -> Engine:
    model = tiny_model(arch, seed=seed, **shape)
    return Engine(EngineConfig(device="cpu", cache=CacheConfig(num_blocks=512)), model=model,
                  tokenizer=byte_tokenizer())  # fmt: skip


def drain(target: Engine, requests: int, tag: str) -> int:
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    for index in range(requests):
        target.add_request(f"{tag}{index}", prompt_token_ids=[3 + (index + t) % 240 for t in range(24)],
                           sampling_params=params)  # fmt: skip
    tokens = 0
    while target.has_unfinished_requests():
        tokens += len(target.step())
    return tokens


def main() -> None:
    torch.set_num_threads(1)
    for label, shape in (("embedded size (hidden 256)", EMBEDDED_SHAPE), ("hidden 768", LARGER_SHAPE)):
        print(label, measure(shape))


def measure(shape: dict) -> str:
    engines = [engine("llama", 1, shape), engine("qwen2", 2, shape)]
    for index, target in enumerate(engines):  # warm-up
        drain(target, 2, f"w{index}-")
    started = time.perf_counter()
    tokens = sum(drain(target, 16, f"s{index}-") for index, target in enumerate(engines))
    sequential = time.perf_counter() - started
    counts = [0, 0]

    def run(index: int) -> None:
        counts[index] = drain(engines[index], 16, f"t{index}-")

    threads = [threading.Thread(target=run, args=(index,)) for index in range(2)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    threaded = time.perf_counter() - started
    assert sum(counts) == tokens
    return (
        f"{tokens} tokens over two engines: sequential {sequential:.2f} s ({tokens / sequential:.0f} tok/s), "
        f"a thread per engine {threaded:.2f} s ({tokens / threaded:.0f} tok/s), speed-up {sequential / threaded:.2f}x"
    )


if __name__ == "__main__":
    main()
