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

    if directory.exists() and not directory.is_dir():  # mkdir would raise FileExistsError
        typer.echo(f"error: DIR {directory} is a file; name a folder to write into (made if missing)", err=True)
        raise typer.Exit(2)
    try:
        written = export(directory)
    except OSError as error:  # a parent that is a file, no permission, ...
        typer.echo(f"error: DIR {directory}: cannot write there: {error}", err=True)
        raise typer.Exit(2) from error
    for path in written:
        typer.echo(str(path))


def _positive(minutes: float) -> float:
    # typer's min= cannot leave out 0 itself, and 0 minutes draws nothing
    if minutes <= 0:
        raise typer.BadParameter(f"must be more than 0, got {minutes:g}")
    return minutes


@dashboards_app.command("render")
def render_command(
    face: Annotated[str, typer.Argument(help="serve | launch")],
    output: Annotated[Path, typer.Argument(help="PNG to write")],
    prometheus: Annotated[str, typer.Option(help="Prometheus base URL")] = "http://localhost:9090",
    minutes: Annotated[float, typer.Option(help="how far back to draw (more than 0)", callback=_positive)] = 15.0,
    window: Annotated[str, typer.Option(help="rate window standing in for $__rate_interval")] = "1m",
) -> None:
    """Draw a dashboard's panels from a Prometheus's answers with matplotlib (no Grafana needed)."""
    from paged_backend.observability.dashboards import DASHBOARDS
    from paged_backend.observability.dashboards.render import PrometheusError, render_recent

    if face not in DASHBOARDS:
        raise typer.BadParameter(f"unknown dashboard {face!r}; choose one of {', '.join(DASHBOARDS)}")
    if not prometheus.startswith(("http://", "https://")):  # else httpx.UnsupportedProtocol, naming no flag
        typer.echo(f"error: --prometheus {prometheus!r} needs http:// or https://, e.g. http://localhost:9090", err=True)
        raise typer.Exit(2)
    try:
        picture = render_recent(face, output, prometheus.rstrip("/"), minutes, window)
    except PrometheusError as error:
        # a 400 is Prometheus refusing the query, whose only part from the command line is the rate window
        flag = f"--window {window!r} (or --prometheus)" if error.status == 400 else f"--prometheus {prometheus}"
        typer.echo(f"error: {flag}: {error}", err=True)
        raise typer.Exit(2) from error
    except OSError as error:  # savefig: a missing folder, a folder, no permission
        typer.echo(f"error: OUTPUT {output}: cannot write it: {error}", err=True)
        raise typer.Exit(2) from error
    typer.echo(str(picture))


def register(app: typer.Typer) -> None:
    app.add_typer(dashboards_app, name="dashboards")
