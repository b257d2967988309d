"""Grafana dashboards for `serve` (paged_backend: metrics) and `launch` (tgi_ metrics), a Prometheus scrape
config and Grafana provisioning files, shipped as package data; `paged-backend dashboards export DIR`
writes them out with the same layout:

    DIR/prometheus.yml                                   scrape config (serve on :8000, launch on :3000)
    DIR/grafana/dashboards/paged-backend-{serve,tgi}.json
    DIR/grafana/provisioning/{datasources,dashboards}/*.yml
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

DASHBOARDS = {"serve": "paged-backend-serve.json", "launch": "paged-backend-tgi.json"}
FILES = (
    "prometheus.yml",
    *(f"grafana/dashboards/{name}" for name in DASHBOARDS.values()),
    "grafana/provisioning/datasources/prometheus.yml",
    "grafana/provisioning/dashboards/paged-backend.yml",
)


def read_text(path: str) -> str:
    """One shipped file, by its path under the export directory."""
    return resources.files(__name__).joinpath(path).read_text()


def dashboard(face: str) -> dict:
    """The Grafana dashboard of `serve` or `launch`."""
    return json.loads(read_text(f"grafana/dashboards/{DASHBOARDS[face]}"))


def panel_queries(board: dict) -> list[tuple[str, str, str]]:
    """(panel title, legend, PromQL expression) for every target of every panel."""
    return [
        (panel["title"], target["legendFormat"], target["expr"])
        for panel in board["panels"]
        for target in panel["targets"]
    ]


def export(directory: str | Path) -> list[Path]:
    """Write every file under `directory` (made if missing); returns the paths written."""
    written = []
    for path in FILES:
        destination = Path(directory) / path
        destination.parent.mkdir(parents=True, exist_ok=True)
        destination.write_text(read_text(path))
        written.append(destination)
    return written
