"""`python -m paged_backend.server [flags]`: the same server and flags as `paged-backend serve`."""

import typer

from paged_backend.server.cli import register

app = typer.Typer(add_completion=False)
register(app)
app()
