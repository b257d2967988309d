"""`paged-backend bench {throughput,latency,serve,quantization}`: vLLM's `vllm bench` shape. Each subcommand hands its
arguments to the benchmark's own argparse parser (so `--help` lists them and benchmarks/*.py share them)."""

from __future__ import annotations

import importlib

import typer

bench_app = typer.Typer(help="Benchmarks: offline throughput, batch-1 latency, online serving.", no_args_is_help=True)
PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}
COMMANDS = {
    "throughput": "Offline throughput: the engine against HF static and HF continuous batching.",
    "latency": "Batch-1 decode latency: the engine against HF generate.",
    "serve": "Online serving load (Poisson or concurrency) against any OpenAI-compatible URL.",
    "quantization": "Quantized weights and fp8 KV pools against fp32: memory, tok/s, agreement, KL.",
}


def _command(name: str, summary: str):
    def command(ctx: typer.Context) -> None:
        import httpx

        from paged_backend.errors import PagedBackendError, one_line

        try:
            importlib.import_module(f"paged_backend.bench.{name}").main(ctx.args)
        except PagedBackendError as error:  # a dataset, model or flag to change: one line, not a traceback
            typer.echo(f"error: {one_line(error)}", err=True)
            raise typer.Exit(2) from error
        except httpx.TransportError as error:  # `bench serve` against a URL where nothing answers
            typer.echo(f"error: no server answered at {error.request.url}: {error}; start one or fix --base-url",
                       err=True)  # fmt: skip
            raise typer.Exit(2) from error

    command.__doc__ = summary
    return command


def register(app: typer.Typer) -> None:
    for name, summary in COMMANDS.items():
        bench_app.command(name, context_settings=PASS_THROUGH, add_help_option=False)(_command(name, summary))
    app.add_typer(bench_app, name="bench")
