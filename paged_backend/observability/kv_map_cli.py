"""`paged-backend kv-map`: fetch a running server's /debug/kv and draw it (`kv_map.draw_kv_map`)."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Annotated

import typer

# What `draw_kv_map` reads from GET /debug/kv: a 200 without them is some other service, not the KV map's data.
SNAPSHOT_KEYS = {"blocks", "swapped", "sliding_windows", "block_size", "stats", "history"}


def kv_map(
    url: Annotated[str, typer.Option(help="the server's base URL (serve it with --enable-debug-routes)")] = (
        "http://127.0.0.1:8000"
    ),
    output: Annotated[
        Path, typer.Option(help="PNG (or .svg, .pdf, ...) to write; the HTML page goes beside it")
    ] = Path("kv_map.png"),
    api_key: Annotated[str | None, typer.Option(envvar="PAGED_BACKEND_API_KEY", help="bearer token, if any")] = None,
    model: Annotated[str | None, typer.Option(help="on a server of several models, whose pool (default: the first)")] = None,
) -> None:
    """Draw a running server's KV pool: one cell per block by owner request, sharing, cache and fill, plus history."""
    from paged_backend.core.kv_map import draw_kv_map, output_paths
    from paged_backend.errors import InvalidRequest

    try:
        output_paths(output)  # a folder or a format savefig cannot write: refused before the fetch, not after
    except InvalidRequest as error:
        typer.echo(f"error: --output {error}", err=True)
        raise typer.Exit(2) from error
    try:
        # the server's root; an OpenAI client's base URL (.../v1), which users copy, names the same server
        query = "?" + urllib.parse.urlencode({"model": model}) if model else ""
        request = urllib.request.Request(url.rstrip("/").removesuffix("/v1") + "/debug/kv" + query)
    except ValueError as error:  # no scheme and no host: "/debug/kv"
        typer.echo(f"error: --url {url!r} is not a URL; give one like http://127.0.0.1:8000", err=True)
        raise typer.Exit(2) from error
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            snapshot = json.load(response)
    except urllib.error.HTTPError as error:
        hints = {404: "; start the server with --enable-debug-routes", 401: "; pass the server's key with --api-key"}
        hint = hints.get(error.code, "")
        typer.echo(f"error: GET {request.full_url} answered {error.code}{hint}", err=True)
        raise typer.Exit(2) from error
    except OSError as error:  # URLError (refused, unknown host, no http://), a timeout, a dropped connection
        reason = getattr(error, "reason", error)
        typer.echo(f"error: cannot reach {request.full_url}: {reason}; check --url", err=True)
        raise typer.Exit(2) from error
    except ValueError:  # not JSON: some other service's page
        snapshot = None
    if not isinstance(snapshot, dict) or not SNAPSHOT_KEYS <= snapshot.keys():
        typer.echo(f"error: GET {request.full_url} did not answer the KV map's data (GET /debug/kv of `paged-backend "
                   "serve --enable-debug-routes`); check --url", err=True)  # fmt: skip
        raise typer.Exit(2)
    try:
        drawing = draw_kv_map(snapshot, output, title=f"KV pool of {url}")
    except InvalidRequest as error:  # matplotlib is not installed
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from error
    except OSError as error:  # a parent folder that is a file, no permission, ...
        typer.echo(f"error: --output {output}: cannot write it: {error}", err=True)
        raise typer.Exit(2) from error
    typer.echo(f"wrote {drawing.png} and {drawing.html}")


def register(app: typer.Typer) -> None:
    app.command("kv-map")(kv_map)
