"""Dense `F.linear` (MKL) against the two prepacked forms the engine has: oneDNN's reordered weight and the panel
kernel (`ops/panel_linear.py`, what `packed_forward` runs where csrc/cpu builds).

For each weight of a model and the row counts a packed step has (a few decodes up to a prefill chunk), prints
GFLOP/s of all three and the panel / oneDNN speed ratio, in float32 and bfloat16. `--shapes smollm2` takes the
real model's layers (q 576x576, k/v 192x576, gate/up 1536x576, down 576x1536, the tied LM head 49152x576), where a
decode step is a stream over the weights; `throughput` (the default) the throughput benchmark's model.

`--model-pass` times instead what a decode step's linear layers cost: one pass over the real model's 30 layers
(stacked q|k|v, o, stacked gate|up, down, as the fused forward calls them) and the LM head, each with its own
weights, so they stream from memory as in the engine.

    OMP_NUM_THREADS=1 python benchmarks/packed_linear.py
    python benchmarks/packed_linear.py --shapes smollm2 --threads 2 --rows 1,2,4,16,64,256
    python benchmarks/packed_linear.py --model-pass --threads 2 --rows 1,16
"""

from __future__ import annotations

import argparse

import torch
from fused_linear import best_seconds  # this script's directory is on sys.path when it runs
from torch import nn

from paged_backend.ops.panel_linear import PanelWeight
from paged_backend.worker.packed_linear import dtype_packs

SHAPES = {
    "throughput": {"q/k/v/o": (768, 768), "gate/up": (2048, 768), "down": (768, 2048), "lm_head": (32000, 768)},
    "smollm2": {"q/o": (576, 576), "k/v": (192, 576), "gate/up": (1536, 576), "down": (576, 1536),
                "lm_head": (49152, 576)},
}  # fmt: skip
MODEL_PASS_LAYERS = 30  # SmolLM2-135M's layers


def model_pass_shapes() -> list[tuple[int, int]]:
    """SmolLM2-135M's linear calls as the fused forward makes them (q|k|v and gate|up stacked), then the LM head."""
    (q, hidden), (kv, _), (gate, _), down = (SHAPES["smollm2"][name] for name in ("q/o", "k/v", "gate/up", "down"))
    layer = [(q + 2 * kv, hidden), (q, hidden), (2 * gate, hidden), down]
    return layer * MODEL_PASS_LAYERS + [SHAPES["smollm2"]["lm_head"]]


def model_pass(rows: list[int], dtypes: list[torch.dtype], repeats: int) -> None:
    """ms per pass over the model's linear calls, and the GFLOP/s that makes."""
    print("\n| dtype | rows | ms per pass | GFLOP/s |\n|---|---:|---:|---:|")
    for dtype in dtypes:
        shapes = model_pass_shapes()
        weights = [PanelWeight(torch.randn(n, k, dtype=dtype) * 0.02) for n, k in shapes]
        for count in rows:
            inputs = {k: torch.randn(count, k, dtype=dtype) for k in {k for _, k in shapes}}
            seconds = best_seconds(lambda: [w(inputs[w.in_features]) for w in weights], repeats)  # noqa: B023
            flops = 2 * count * sum(n * k for n, k in shapes)
            name = str(dtype).removeprefix("torch.")
            print(f"| {name} | {count} | {seconds * 1e3:.2f} | {flops / seconds / 1e9:.0f} |")


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="throughput")
    parser.add_argument("--rows", default="1,2,4,8,16,64,256")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--model-pass", action="store_true", help="time one pass over the real model's linear calls")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    if args.model_pass:
        model_pass(rows, [getattr(torch, name) for name in args.dtypes.split(",")], min(args.repeats, 10))
        return
    for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
        onednn = dtype_packs(dtype)
        print(f"\n{dtype}, {args.threads} thread(s), best of {args.repeats}: GFLOP/s of dense / oneDNN / panel "
              f"(panel speed-up over oneDNN){'' if onednn else '; oneDNN does not pack this dtype here'}")  # fmt: skip
        print("| weight | " + " | ".join(f"{r} rows" for r in rows) + " |")
        print("|---|" + "---|" * len(rows))
        for name, (out_features, in_features) in SHAPES[args.shapes].items():
            layer = nn.Linear(in_features, out_features, bias=False, dtype=dtype)
            reordered = torch.ops.mkldnn._reorder_linear_weight(layer.weight) if onednn else None
            panel = PanelWeight(layer.weight)
            cells = []
            for count in rows:
                x = torch.randn(count, in_features, dtype=dtype)
                flops = 2 * count * in_features * out_features
                dense = best_seconds(lambda: layer(x), args.repeats)  # noqa: B023
                ours = best_seconds(lambda: panel(x), args.repeats)  # noqa: B023
                if reordered is None:
                    cells.append(f"{flops / dense / 1e9:.0f} / - / {flops / ours / 1e9:.0f}")
                    continue
                packed = best_seconds(
                    lambda: torch.ops.mkldnn._linear_pointwise(x, reordered, None, "none", [], ""),  # noqa: B023
                    args.repeats,
                )
                cells.append(f"{flops / dense / 1e9:.0f} / {flops / packed / 1e9:.0f} / {flops / ours / 1e9:.0f} "
                             f"({packed / ours:.2f}x)")  # fmt: skip
            print(f"| {name} {out_features}x{in_features} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
