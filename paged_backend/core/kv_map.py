"""Draw a pool snapshot (`kv_snapshot.pool_snapshot`) as a PNG and an HTML page, with matplotlib.

One panel per layer group shows every block id as a cell: coloured by the request that holds it, hatched with
its reference count when shared, grey when prefix-cached (free but reusable), white when free, faint when
another group holds it. A held block's colour fills the cell as far as its tokens do (a partly filled last
block shows its fill). CPU blocks of swapped-out sequences get their own panel, and the last panel plots
pool usage and waste over the engine's recent steps.

>>> drawing = draw_kv_map(llm.engine.kv_snapshot(), "kv_map.png")   # doctest: +SKIP
>>> drawing.png, drawing.html, drawing.cells[0]["shared"]          # doctest: +SKIP
"""

from __future__ import annotations

import base64
import html
import io
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from paged_backend.errors import InvalidRequest

STATE_COLORS = {"cached": "#b0b0b0", "free": "#ffffff", "other": "#e3dff0"}
SEVERAL_OWNERS = "#444444"


@dataclass(frozen=True)
class KVMapDrawing:
    png: Path
    html: Path
    cells: list[Counter]  # per group panel: cells drawn per state ("owned", "shared", "cached", "free", "other")
    swapped_cells: int


def _matplotlib():
    try:
        from matplotlib.collections import PatchCollection
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch, Rectangle
    except ImportError as error:
        raise InvalidRequest(f"the KV map is drawn with matplotlib, which is not installed ({error}); "
                             "install paged-backend[viz]") from error  # fmt: skip
    return Figure, PatchCollection, Patch, Rectangle


def output_paths(path: str | Path) -> tuple[Path, Path]:
    """The picture and the HTML page `draw_kv_map(snapshot, path)` writes, checked before anything is drawn (or
    fetched): a folder, or a suffix savefig cannot write, raises InvalidRequest. No suffix means .png, which
    savefig would add on its own; the paths returned say so."""
    picture = Path(path)
    if picture.is_dir():  # savefig would write a sibling `path`.png, not a file in the folder
        raise InvalidRequest(f"{picture} is a folder; name the picture to write, e.g. {picture / 'kv_map.png'}")
    picture = picture if picture.suffix else picture.with_suffix(".png")
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:  # drawing says which extra to install
        return picture, picture.with_suffix(".html")
    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    if picture.suffix[1:].lower() not in formats:
        raise InvalidRequest(f"{picture}: matplotlib cannot write a {picture.suffix} picture; name one ending in "
                             f"{', '.join('.' + name for name in formats)} (the HTML page goes beside it)")  # fmt: skip
    return picture, picture.with_suffix(".html")


def _owner_colors(snapshot: dict) -> dict[str, str]:
    from matplotlib import colormaps

    names = sorted({b["owner"] for b in snapshot["blocks"] if b["owner"]} | {s["owner"] for s in snapshot["swapped"]})
    names = [name for name in names if name != "(several)"]
    palette = colormaps["tab20"]
    colors = {name: palette(i % 20) for i, name in enumerate(names)}
    colors["(several)"] = SEVERAL_OWNERS
    return colors


def _grid(count: int) -> int:
    return max(8, min(64, math.ceil(math.sqrt(count * 3))))


def _draw_cells(ax, cells: list[dict], colors: dict, block_size: int, Rectangle, PatchCollection) -> Counter:
    """Cells in rows of `_grid` columns; one PatchCollection per state (gid = state) so drawn cells can be counted."""
    columns = _grid(len(cells))
    by_state: dict[str, list] = {}
    faces: dict[str, list] = {}
    edges: dict[str, list] = {}
    fills, fill_colors, labels = [], [], []
    for index, cell in enumerate(cells):
        x, y = index % columns, -(index // columns)
        state = cell["state"]
        by_state.setdefault(state, []).append(Rectangle((x, y), 0.92, 0.92))
        held = state in ("owned", "shared", "swapped")
        faces.setdefault(state, []).append("#ffffff" if held else STATE_COLORS.get(state, "#ffffff"))
        edges.setdefault(state, []).append(colors.get(cell["owner"], SEVERAL_OWNERS) if held else "#999999")
        if held and cell["fill"]:
            fills.append(Rectangle((x, y), 0.92, 0.92 * cell["fill"] / block_size))
            fill_colors.append(colors.get(cell["owner"], SEVERAL_OWNERS))
        if state == "shared":
            labels.append((x + 0.46, y + 0.46, str(cell["ref_count"])))
    counts = Counter()
    for state, patches in by_state.items():
        hatch = "///" if state == "shared" else ("..." if state == "cached" else None)
        collection = PatchCollection(patches, facecolors=faces[state], edgecolors=edges[state], linewidths=0.6,
                                     hatch=hatch, gid=state)  # fmt: skip
        ax.add_collection(collection)
        counts[state] = len(patches)
    if fills:
        ax.add_collection(PatchCollection(fills, facecolors=fill_colors, linewidths=0, gid="fill", alpha=0.85))
    for x, y, text in labels:
        ax.text(x, y, text, ha="center", va="center", fontsize=6, color="white", fontweight="bold")
    rows = max(1, math.ceil(len(cells) / columns))
    ax.set_xlim(-0.2, columns + 0.2)
    ax.set_ylim(-rows + 0.8, 1.1)
    ax.set_aspect("equal")
    ax.axis("off")
    return counts


def _group_title(snapshot: dict, group: int) -> str:
    window = snapshot["sliding_windows"][group]
    stats = snapshot["stats"]["groups"][group] if snapshot["stats"]["groups"] else snapshot["stats"]
    kind = "full attention" if window is None else f"sliding window {window}"
    return (f"group {group} ({kind}): {stats['used_blocks']} used, {stats['shared_blocks']} shared, "
            f"{stats['cached_blocks']} cached")  # fmt: skip


def draw_kv_map(snapshot: dict, path: str | Path = "kv_map.png", *, title: str = "KV pool") -> KVMapDrawing:
    """Write `path` (PNG, or another format savefig writes; no suffix means .png) and the same name with .html;
    returns the paths and the cells drawn per panel."""
    Figure, PatchCollection, Patch, Rectangle = _matplotlib()
    png, page = output_paths(path)
    colors = _owner_colors(snapshot)
    groups = len(snapshot["sliding_windows"])
    has_swapped = bool(snapshot["swapped"])
    panels = groups + has_swapped + 1
    figure = Figure(figsize=(10, 2.6 * panels), layout="constrained")
    axes = figure.subplots(panels, 1, squeeze=False)[:, 0]
    cells_per_group = []
    for group in range(groups):
        cells = [b if b["group"] in (group, None) else {**b, "state": "other"} for b in snapshot["blocks"]]
        counts = _draw_cells(axes[group], cells, colors, snapshot["block_size"], Rectangle, PatchCollection)
        axes[group].set_title(_group_title(snapshot, group), fontsize=9, loc="left")
        cells_per_group.append(counts)
    swapped_cells = 0
    if has_swapped:
        cells = [{**entry, "state": "swapped", "ref_count": 1} for entry in snapshot["swapped"]]
        swapped_cells = _draw_cells(axes[groups], cells, colors, snapshot["block_size"], Rectangle, PatchCollection)[
            "swapped"
        ]
        axes[groups].set_title(f"swapped to CPU: {swapped_cells} blocks", fontsize=9, loc="left")
    _draw_history(axes[-1], snapshot["history"])
    legend = [Patch(facecolor=color, label=name) for name, color in list(colors.items())[:16]]
    legend += [
        Patch(facecolor="#ffffff", edgecolor="#888888", hatch="///", label="shared (ref count)"),
        Patch(facecolor=STATE_COLORS["cached"], edgecolor="#888888", hatch="...", label="prefix-cached, evictable"),
        Patch(facecolor=STATE_COLORS["free"], edgecolor="#888888", label="free"),
        Patch(facecolor=STATE_COLORS["other"], edgecolor="#888888", label="another group's"),
    ]
    figure.legend(handles=legend, loc="outside lower center", fontsize=7, ncols=min(6, len(legend)))
    stats = snapshot["stats"]
    figure.suptitle(
        f"{title}: {stats['used_blocks']} of {stats['total_blocks']} blocks used ({100 * stats['usage']:.0f}%), "
        f"{stats['free_blocks']} free, {stats['cached_blocks']} cached; waste {stats['waste_pct']:.1f}%; "
        f"block size {snapshot['block_size']}",
        fontsize=10,
    )
    png.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(png, dpi=110)
    page.write_text(_html_page(figure, snapshot, title))
    return KVMapDrawing(png, page, cells_per_group, swapped_cells)


def _draw_history(ax, history: list[dict]) -> None:
    ax.set_title("pool over recent steps", fontsize=9, loc="left")
    if not history:
        ax.text(0.5, 0.5, "no steps recorded yet", ha="center", va="center", transform=ax.transAxes)
        return
    steps = [point["step"] for point in history]
    ax.plot(steps, [100 * point["usage"] for point in history], label="usage % (blocks held)")
    ax.plot(steps, [point["waste_pct"] for point in history], label="waste % (empty slots in held blocks)")
    ax.plot(steps, [100 * point["shared_blocks"] / max(1, point["used_blocks"]) for point in history],
            label="shared % of held blocks", linestyle="--")  # fmt: skip
    ax.set_xlabel("engine step")
    ax.set_ylabel("%")
    ax.set_ylim(0, 100)
    ax.legend(fontsize=7, loc="upper left")


def _html_page(figure, snapshot: dict, title: str) -> str:
    """The PNG inline plus per-group numbers: one self-contained file to open or attach."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    image = base64.b64encode(buffer.getvalue()).decode()
    groups = snapshot["stats"]["groups"]
    rows = "".join(
        f"<tr><td>{g}</td><td>{html.escape(str(snapshot['sliding_windows'][g] or 'full'))}</td>"
        f"<td>{s['used_blocks']}</td><td>{s['shared_blocks']}</td><td>{s['cached_blocks']}</td>"
        f"<td>{s['tokens_stored']}</td></tr>"
        for g, s in enumerate(groups)
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head><body>"
        f"<h1>{html.escape(title)}</h1><img alt='KV pool map' src='data:image/png;base64,{image}'>"
        "<table border='1' cellpadding='4'><tr><th>group</th><th>window</th><th>used</th><th>shared</th>"
        f"<th>cached</th><th>tokens stored</th></tr>{rows}</table></body></html>"
    )
