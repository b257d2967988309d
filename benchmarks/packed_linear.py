"""Dense `F.linear` (MKL) against the engine's prepacked oneDNN layers, at the throughput model's shapes.

For each weight of the full benchmark model (q/k/v/o 768x768, gate/up 2048x768, down 768x2048, LM head 32000x768)
and the row counts a packed step has (a few decodes up to a prefill chunk), prints GFLOP/s of both and the
packed / dense speed ratio, in float32 and bfloat16. The packed side is `packed_forward`, what the runner swaps in.

    OMP_NUM_THREADS=1 python benchmarks/packed_linear.py
"""

from __future__ import annotations

import argparse

import torch
from fused_linear import best_seconds  # this script's directory is on sys.path when it runs
from torch import nn

from paged_backend.worker.packed_linear import packed_forward

SHAPES = {"q/k/v/o": (768, 768), "gate/up": (2048, 768), "down": (768, 2048), "lm_head": (32000, 768)}


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16,64,256")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
        print(f"\n{dtype}, {args.threads} thread(s), best of {args.repeats}: dense / packed GFLOP/s (packed speed-up)")
        print("| weight | " + " | ".join(f"{r} rows" for r in rows) + " |")
        print("|---|" + "---|" * len(rows))
        for name, (out_features, in_features) in SHAPES.items():
            layer = nn.Linear(in_features, out_features, bias=False, dtype=dtype)
            packed = packed_forward(layer)
            cells = []
            for count in rows:
                x = torch.randn(count, in_features, dtype=dtype)
                flops = 2 * count * in_features * out_features
                dense = best_seconds(lambda: layer(x), args.repeats)  # noqa: B023
                fast = best_seconds(lambda: packed(x), args.repeats)  # noqa: B023
                cells.append(f"{flops / dense / 1e9:.0f} / {flops / fast / 1e9:.0f} ({dense / fast:.2f}x)")
            print(f"| {name} {out_features}x{in_features} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
