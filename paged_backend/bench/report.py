"""What every bench prints and writes: percentiles, a markdown table, a JSON file, a matplotlib figure."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank `q`-th percentile (0-100) of `values`; NaN when there are none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def distribution_ms(values: Sequence[float], percentiles: Sequence[float] = (50, 99)) -> dict[str, float]:
    """Mean and percentiles of durations in seconds, in milliseconds."""
    summary = {"mean": statistics.fmean(values) * 1000 if values else math.nan}
    for q in percentiles:
        summary[f"p{q:g}"] = percentile(values, q) * 1000
    return summary


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: str | Path | None, payload: object) -> None:
    if path:
        Path(path).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"results: {path}")


def write_plot(path: str | Path | None, draw: Callable) -> None:
    """`draw(plt)` makes a figure; it is saved at `path` (skipped, with a note, without matplotlib)."""
    if not path:
        return
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install 'paged-backend[bench]'); skipping the plot")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure = draw(plt)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    print(f"plot: {path}")
