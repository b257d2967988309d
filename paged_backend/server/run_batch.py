"""`paged-backend run-batch -i requests.jsonl -o results.jsonl`: an OpenAI batch file, offline (vLLM's command).

Each line runs through the server's own app in process (batch_lines), with the engine started around the run,
so an output line is what the online route answers for the same request: the same body, the same 400 for a bad
one. Lines run concurrently, so the engine batches them; the output keeps the input's order. The summary on
stderr counts the lines and the tokens their answers report (what a /v1/batches batch object's usage sums).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from paged_backend import startup
from paged_backend.engine.args import EngineArgs
from paged_backend.engine.args_typer import add_engine_command
from paged_backend.errors import PagedBackendError, one_line
from paged_backend.server.batch_lines import (
    USAGE_KEYS,
    BatchLine,
    InProcessClient,
    add_usage,
    parse_lines,
    succeeded,
)


def run_batch(
    engine: EngineArgs,
    input_file: Annotated[
        Path,
        typer.Option("--input-file", "-i", exists=True, dir_okay=False, help="OpenAI batch input: JSONL request lines"),
    ],
    output_file: Annotated[
        Path, typer.Option("--output-file", "-o", dir_okay=False, help="JSONL output lines, in the input's order")
    ],
    served_model_name: Annotated[
        str | None, typer.Option(help="the model name request bodies use; default: --model")
    ] = None,
    progress: Annotated[bool, typer.Option(help="show a progress bar on stderr")] = True,
) -> None:
    """Run an OpenAI batch file (/v1/chat/completions, /v1/completions, /v1/responses lines) offline."""
    from paged_backend.engine import Engine
    from paged_backend.engine.async_engine import EngineThread
    from paged_backend.server.app import build_app
    from paged_backend.server.state import ServerSettings

    if not output_file.parent.is_dir():  # said now, not after the whole run
        typer.echo(f"error: --output-file's folder {output_file.parent} does not exist; create it or write elsewhere",
                   err=True)  # fmt: skip
        raise typer.Exit(2)
    try:  # a BOM: saved on Windows; not UTF-8 at all: one error, not one per line
        lines = parse_lines(input_file.read_text(encoding="utf-8-sig"))
    except UnicodeDecodeError as error:
        typer.echo(f"error: --input-file is not UTF-8 text ({error.reason} at byte {error.start})", err=True)
        raise typer.Exit(2) from error
    engine_thread = EngineThread()  # built where it will step, as serve does
    try:
        built = engine_thread.submit(lambda: Engine(engine.to_engine_config())).result()
    except (PagedBackendError, ValidationError) as error:
        typer.echo(f"error: {one_line(error)}", err=True)
        raise typer.Exit(2) from error
    app = build_app(built, ServerSettings(served_model_name=served_model_name), engine_thread=engine_thread)
    startup.started()
    began = time.perf_counter()
    try:
        outputs = asyncio.run(_run_lines(app, lines, built.config.scheduler.max_num_seqs, progress))
    finally:
        built.close()
    output_file.write_text("".join(json.dumps(output) + "\n" for output in outputs))
    typer.echo(summary(outputs, time.perf_counter() - began), err=True)


def summary(outputs: list[dict], elapsed: float) -> str:
    """One line: the lines answered and failed, and the tokens the answers used."""
    ok, usage = sum(succeeded(output) for output in outputs), dict.fromkeys(USAGE_KEYS, 0)
    for output in outputs:
        usage = add_usage(usage, output)
    tokens = (f"{usage['input_tokens']} input tokens ({usage['cached_tokens']} cached), "
              f"{usage['output_tokens']} output tokens")  # fmt: skip
    return f"{len(outputs)} lines in {elapsed:.1f} s: {ok} answered, {len(outputs) - ok} failed; {tokens}"


async def _run_lines(app, lines: list[BatchLine], concurrency: int, progress: bool) -> list[dict]:
    from tqdm.auto import tqdm

    async_engine = app.state.server.async_engine
    await async_engine.start()
    client = InProcessClient(app, api_key=None)
    slots = asyncio.Semaphore(concurrency)  # as many as the engine runs at once: continuous batching fills up
    bar = tqdm(total=len(lines), unit="req", desc="run-batch", disable=not progress, file=sys.stderr)

    async def run(line: BatchLine) -> dict:
        async with slots:
            output = await client.run(line)  # offline, nothing turns a line away for a while
        bar.update(1)
        return output

    try:
        return await asyncio.gather(*(run(line) for line in lines))
    finally:
        bar.close()
        await client.aclose()
        await async_engine.shutdown(drain_timeout=5)  # every line has finished: nothing to wait for


def register(app: typer.Typer) -> None:
    """Add the `run-batch` command to a Typer app (the `paged-backend` CLI)."""
    add_engine_command(app, "run-batch", run_batch)
