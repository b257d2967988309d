"""`paged-backend dashboards export DIR`: the Grafana dashboards, scrape config and provisioning files."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

dashboards_app = typer.Typer(help="Grafana dashboards and a Prometheus scrape config for serve and launch.")


@dashboards_app.command("export")
def export_command(
    directory: Annotated[Path, typer.Argument(help="where to write them (made if missing)")],
) -> None:
    """Write prometheus.yml, grafana/dashboards/*.json and grafana/provisioning/ under DIR."""
    from paged_backend.observability.dashboards import export

    for path in export(directory):
        typer.echo(str(path))


@dashboards_app.command("render")
def render_command(
    face: Annotated[str, typer.Argument(help="serve | launch")],
    output: Annotated[Path, typer.Argument(help="PNG to write")],
    prometheus: Annotated[str, typer.Option(help="Prometheus base URL")] = "http://localhost:9090",
    minutes: Annotated[float, typer.Option(help="how far back to draw")] = 15.0,
    window: Annotated[str, typer.Option(help="rate window standing in for $__rate_interval")] = "1m",
) -> None:
    """Draw a dashboard's panels from a Prometheus's answers with matplotlib (no Grafana needed)."""
    from paged_backend.observability.dashboards import DASHBOARDS
    from paged_backend.observability.dashboards.render import render_recent

    if face not in DASHBOARDS:
        raise typer.BadParameter(f"unknown dashboard {face!r}; choose one of {', '.join(DASHBOARDS)}")
    typer.echo(str(render_recent(face, output, prometheus.rstrip("/"), minutes, window)))


def register(app: typer.Typer) -> None:
    app.add_typer(dashboards_app, name="dashboards")
