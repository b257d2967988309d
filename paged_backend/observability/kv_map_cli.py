"""`paged-backend kv-map`: fetch a running server's /debug/kv and draw it (`kv_map.draw_kv_map`)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Annotated

import typer


def kv_map(
    url: Annotated[str, typer.Option(help="the server's base URL (serve it with --enable-debug-routes)")] = (
        "http://127.0.0.1:8000"
    ),
    output: Annotated[Path, typer.Option(help="PNG to write; the HTML page goes beside it")] = Path("kv_map.png"),
    api_key: Annotated[str | None, typer.Option(envvar="PAGED_BACKEND_API_KEY", help="bearer token, if any")] = None,
) -> None:
    """Draw a running server's KV pool: one cell per block by owner request, sharing, cache and fill, plus history."""
    from paged_backend.core.kv_map import draw_kv_map

    request = urllib.request.Request(url.rstrip("/") + "/debug/kv")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            snapshot = json.load(response)
    except urllib.error.HTTPError as error:
        hint = "; start the server with --enable-debug-routes" if error.code == 404 else ""
        typer.echo(f"error: GET {request.full_url} answered {error.code}{hint}", err=True)
        raise typer.Exit(2) from error
    except urllib.error.URLError as error:
        typer.echo(f"error: cannot reach {request.full_url}: {error.reason}", err=True)
        raise typer.Exit(2) from error
    drawing = draw_kv_map(snapshot, output, title=f"KV pool of {url}")
    typer.echo(f"wrote {drawing.png} and {drawing.html}")


def register(app: typer.Typer) -> None:
    app.command("kv-map")(kv_map)
