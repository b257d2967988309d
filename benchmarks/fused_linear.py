"""Would fusing q/k/v and gate/up into one matmul each speed up the engine's linear layers on this CPU?

Times, at the full throughput model's shapes (hidden 768, intermediate 2048), the separate projections against one
fused matmul over the concatenated weights (then split), for the row counts a packed step has: a few decodes,
a batch of decodes, a prefill chunk. Prints GFLOP/s and the fused / separate ratio.

    OMP_NUM_THREADS=1 python benchmarks/fused_linear.py
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.nn.functional import linear


def best_seconds(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--rows", default="4,16,64,256")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    h, m = args.hidden, args.intermediate
    qkv = [torch.randn(h, h) for _ in range(3)]
    gate_up = [torch.randn(m, h) for _ in range(2)]
    fused_qkv, fused_gate_up = torch.cat(qkv), torch.cat(gate_up)
    print(f"hidden {h}, intermediate {m}, {args.threads} thread(s), float32, best of {args.repeats}")
    print("| rows | qkv separate GFLOP/s | qkv fused GFLOP/s | ratio | gate/up separate | gate/up fused | ratio |")
    print("|---|---|---|---|---|---|---|")
    for rows in map(int, args.rows.split(",")):
        x = torch.randn(rows, h)
        cells = []
        for weights, fused in ((qkv, fused_qkv), (gate_up, fused_gate_up)):
            flops = 2 * rows * sum(w.numel() for w in weights)
            separate = best_seconds(lambda: [linear(x, w) for w in weights], args.repeats)  # noqa: B023
            together = best_seconds(lambda: linear(x, fused).split(weights[0].shape[0], -1), args.repeats)  # noqa: B023
            cells += [f"{flops / separate / 1e9:.0f}", f"{flops / together / 1e9:.0f}", f"{separate / together:.2f}x"]
        print(f"| {rows} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
