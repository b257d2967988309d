"""`paged-backend` command line. Subcommands register themselves from their own modules."""

import typer

app = typer.Typer(help="paged-backend: paged KV cache + continuous batching", no_args_is_help=True)


@app.command()
def version() -> None:
    """Print the installed version."""
    from paged_backend import __version__

    typer.echo(__version__)
