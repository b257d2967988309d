"""Throughput cost of offloading weights with accelerate (`--cpu-offload-gb`), measured in one run.

Builds a seeded Llama (safetensors in a temp dir), then runs the same greedy batch through the engine with
0 GiB offloaded (the baseline) and with growing `cpu_offload_gb`. On a CPU run the offloaded layers live on
disk (the safetensors file, read through the page cache) and accelerate copies their weights in at each
forward; on a GPU they live in CPU memory and cross PCIe. Prints tokens/s per setting, the offloaded GiB
actually placed off the device, and the extra seconds per generated token per offloaded GiB.

    python benchmarks/offload.py --threads 2
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from paged_backend.engine import Engine, SamplingParams
from paged_backend.engine.engine import engine_config
from paged_backend.worker.models import byte_tokenizer, tiny_model

GIB = 1 << 30


def offloaded_bytes(model) -> int:
    """Bytes of the weights accelerate placed off the execution device (in CPU memory or on disk)."""
    from accelerate.utils import compute_module_sizes

    sizes = compute_module_sizes(model, dtype=model.dtype)
    main = {"cpu"} if model.device.type in ("cpu", "meta") else {model.device.index}
    off_tiers = {"disk"} if main == {"cpu"} else {"cpu", "disk"}
    return sum(sizes[name] for name, device in model.hf_device_map.items() if device in off_tiers)


def run_once(engine: Engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """(generated tokens per second, seconds per engine step) for one batch."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{time.perf_counter_ns()}-{index}", prompt_token_ids=prompt, sampling_params=params)
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    elapsed = time.perf_counter() - start
    return len(prompts) * new_tokens / elapsed, elapsed / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--offload-gb", type=float, nargs="+", default=[0.0, 0.05, 0.1, 0.15])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = tempfile.mkdtemp(prefix="offload-bench-")
    model = tiny_model("llama", seed=0, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2,
                       intermediate_size=2048)  # fmt: skip
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    del model
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 250, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
    engines = {}
    for gb in args.offload_gb:
        placement = {"cpu_offload_gb": gb} if gb > 0 else {}
        engines[gb] = Engine(engine_config(model=folder, device="cpu", num_blocks=256, **placement))
    best = {gb: (0.0, float("inf")) for gb in engines}
    for _ in range(args.repeats):  # interleaved, so machine load hits every setting alike
        for gb, engine in engines.items():
            best[gb] = max(best[gb], run_once(engine, prompts, args.new_tokens))
    base_rate, base_step = best[args.offload_gb[0]]
    print(f"model weights {weights / GIB:.3f} GiB; batch {args.batch}, prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens, {args.threads} threads, best of {args.repeats}")  # fmt: skip
    print(
        "| --cpu-offload-gb | offloaded GiB | tokens/s | vs none | ms per step | extra ms per step per offloaded GiB |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for gb, engine in engines.items():
        rate, step = best[gb]
        off = offloaded_bytes(engine.model) / GIB if gb > 0 else 0.0
        extra = f"{(step - base_step) * 1000 / off:.0f}" if off else "-"
        print(f"| {gb} | {off:.3f} | {rate:.1f} | {rate / base_rate:.2f}x | {step * 1000:.1f} | {extra} |")


if __name__ == "__main__":
    main()
