"""A dashboard's panels drawn with matplotlib from a Prometheus's answers: the picture a Grafana would show,
where no Grafana runs (docs/operations.md's figure, a quick look from a terminal).

    paged-backend dashboards render serve dashboard.png --prometheus http://localhost:9090 --minutes 15
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import httpx

from paged_backend.observability.dashboards import dashboard


def promql(expression: str, window: str = "1m", instance: str = ".*") -> str:
    """A panel's expression with Grafana's variables given values Prometheus understands."""
    for variable, value in (("$__rate_interval", window), ("$__range", window), ("$instance", instance)):
        expression = expression.replace(variable, value)
    return expression


class PrometheusError(Exception):
    """Prometheus could not be asked, refused a query (`status` 400: the query, e.g. its rate window) or answered
    something other than a query_range result; the message says which, for one line of a command's output."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def query_range(prometheus: str, expression: str, start: float, end: float, step: float) -> list[dict]:
    url = f"{prometheus}/api/v1/query_range"
    try:
        response = httpx.get(url, params=dict(query=expression, start=start, end=end, step=step), timeout=30)
    except (httpx.HTTPError, httpx.InvalidURL) as error:  # refused, timed out, no http:// scheme, ...
        raise PrometheusError(f"cannot reach {url}: {str(error) or type(error).__name__}") from error
    try:
        body = response.json()
    except ValueError:  # an HTML page, say: not a Prometheus
        body = None
    if response.status_code != 200:
        detail = body.get("error") if isinstance(body, dict) else None  # Prometheus says why it refused a query
        raise PrometheusError(f"GET {url} answered {response.status_code}" + (f": {detail}" if detail else ""),
                              response.status_code)  # fmt: skip
    try:
        return body["data"]["result"]
    except (TypeError, KeyError) as error:
        raise PrometheusError(f"GET {url} did not answer a Prometheus query_range result") from error


def render(face: str, path: str | Path, prometheus: str, start: float, end: float, window: str = "1m") -> Path:
    """Draw every panel of `face`'s dashboard over [start, end] into a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    board = dashboard(face)
    panels = board["panels"]
    columns = 2
    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(12, 2.6 * rows), squeeze=False)
    step = max((end - start) / 200, 1.0)
    for axis, panel in zip(axes.flat, panels, strict=False):
        for target in panel["targets"]:
            for series in query_range(prometheus, promql(target["expr"], window), start, end, step):
                times = [float(t) - start for t, _ in series["values"]]
                values = [float(v) for _, v in series["values"]]
                label = target["legendFormat"].replace("{{instance}}", "").strip()
                for name, value in series["metric"].items():
                    label = label.replace("{{" + name + "}}", value)
                axis.plot(times, values, label=label or target["expr"][:30], linewidth=1.2)
        unit = panel["fieldConfig"]["defaults"].get("unit", "")
        axis.set_title(panel["title"], fontsize=9)
        axis.set_xlabel("seconds", fontsize=7)
        axis.set_ylabel(
            {"s": "seconds", "percentunit": "fraction", "reqps": "req/s", "ops": "per second"}.get(unit, ""), fontsize=7
        )
        axis.tick_params(labelsize=7)
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=6, loc="upper right")
    for axis in list(axes.flat)[len(panels) :]:
        axis.set_visible(False)
    figure.suptitle(f"{board['title']}: panels from Prometheus", fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)
    return Path(path)


def render_recent(face: str, path: str | Path, prometheus: str, minutes: float, window: str = "1m") -> Path:
    end = time.time()
    return render(face, path, prometheus, end - 60 * minutes, end, window)
