"""`paged-backend launch`, registered on the project's typer app; argument parsing stays TGI's own."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add `launch` to `app`; every argument goes to the TGI flag parser (so `launch --help` lists TGI's flags)."""

    @app.command(
        "launch",
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
        add_help_option=False,
        help="Serve the TGI HTTP API with text-generation-launcher's flags; --backend paged|reference|grpc.",
    )
    def launch(ctx: typer.Context) -> None:
        from paged_backend.tgi.launcher.launch import main

        main(list(ctx.args))
