"""Where an engine step goes on a GPU: wall time per step against GPU kernel time per step, and the host-side ops
that cost the most (synchronising copies among them), from torch.profiler over a decode-heavy run of the throughput
benchmark's ~134M-parameter Llama.

    python benchmarks/gpu_step_profile.py --dtype bfloat16 --requests 64 --max-tokens 64
    python benchmarks/gpu_step_profile.py --max-cudagraph-capture-size 64     # decode steps replayed from graphs
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from paged_backend.bench.throughput import bench_model
from paged_backend.engine import LLM, SamplingParams
from paged_backend.worker.models import byte_tokenizer

# host calls that wait for the GPU, or copy to or from it: each one a stall of the step's launch stream
HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "aten::_local_scalar_dense")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--max-cudagraph-capture-size", type=int, default=0, help="decode graphs (0: eager)")
    parser.add_argument("--device", default="cuda", help="cpu to try the script where there is no GPU")
    parser.add_argument("--rows", type=int, default=25, help="rows of the host-op table")
    args = parser.parse_args()

    model, description = bench_model(False, 32000, 0, args.dtype)
    rng = random.Random(0)
    prompts = [[rng.randrange(32000) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
    blocks = args.requests * (args.prompt_tokens + args.max_tokens) // 16 + args.requests + 16
    llm = LLM(model.to(args.device), tokenizer=byte_tokenizer(), block_size=16, num_blocks=blocks,
              attention_backend=args.attention_backend,
              max_cudagraph_capture_size=args.max_cudagraph_capture_size)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    # warm up at the timed batch size, so that the timed run compiles no Triton specialization of its own (decode
    # graphs were captured when the engine started): with 2 tokens no decode step held all the requests, with 4 one does
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))

    steps_before = llm.engine.stats().num_steps
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    started = time.perf_counter()
    llm.generate(prompts, params)
    wall = time.perf_counter() - started
    steps = llm.engine.stats().num_steps - steps_before

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        llm.generate(prompts, params)
    events = prof.key_averages()
    gpu_ms = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=48))
    graphs = llm.engine.runner.decode_graphs  # the summary last, where a log's tail shows it
    print(f"model: {description}, backend {args.attention_backend}, decode graphs up to "
          f"{args.max_cudagraph_capture_size} sequences; {args.requests} requests x {args.prompt_tokens} prompt + "
          f"{args.max_tokens} output tokens")  # fmt: skip
    if graphs is not None:
        print(f"decode graphs: {len(graphs.graphs)} captured, {graphs.replays} replays of {graphs.steps} decode steps")
    print(f"{steps} steps in {wall:.2f} s: {1e3 * wall / steps:.2f} ms a step wall clock, "
          f"{gpu_ms / steps:.2f} ms a step of GPU kernels (under the profiler)")  # fmt: skip
    for event in events:
        if event.key in HOST_WAITS:
            print(f"  {event.key:<28} {event.count / steps:7.1f} calls a step, "
                  f"{event.self_cpu_time_total / 1e3 / steps:7.3f} ms a step")  # fmt: skip


if __name__ == "__main__":
    main()
