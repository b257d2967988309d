"""`paged-backend` command line: `version` and `run` here; `serve`, `run-batch`, `launch`, `dashboards` and `bench`
register from their own modules."""

from __future__ import annotations

import importlib
import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from paged_backend import startup
from paged_backend.engine.args import EngineArgs
from paged_backend.engine.args_typer import add_engine_command

# Plain (click) help: rich's panels cut long flag names short in a narrow terminal or a pipe.
app = typer.Typer(
    help="paged-backend: paged KV cache + continuous batching", no_args_is_help=True, rich_markup_mode=None
)

# Modules that add their own subcommands through `register(app)`; one whose extra is not installed is skipped.
COMMAND_MODULES = (
    "paged_backend.server.cli",
    "paged_backend.server.run_batch",
    "paged_backend.tgi.launcher.cli",
    "paged_backend.observability.dashboards.cli",
    "paged_backend.bench.cli",
    "paged_backend.observability.kv_map_cli",
)


@app.command()
def version() -> None:
    """Print the installed version."""
    from paged_backend import __version__

    typer.echo(__version__)


def read_prompts(text: str, *, jsonl: bool | None = None) -> list[dict]:
    """Prompts from a text file body (one per line) or JSONL (`{"prompt": ..., <sampling fields>}`).

    >>> read_prompts('{"prompt": "hi", "max_tokens": 3}')
    [{'prompt': 'hi', 'max_tokens': 3}]
    >>> read_prompts("first\\nsecond\\n")
    [{'prompt': 'first'}, {'prompt': 'second'}]
    """
    lines = [line for line in text.splitlines() if line.strip()]
    if jsonl is None:
        jsonl = bool(lines) and lines[0].lstrip().startswith("{")
    if not jsonl:
        return [{"prompt": line} for line in lines]
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise typer.BadParameter(f"line {number} is not valid JSON: {error}") from error
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise typer.BadParameter(f'line {number} needs a "prompt" string field')
        records.append(record)
    return records


def _result_line(index: int, prompt: str, output) -> str:
    metrics = output.metrics
    record = {
        "index": index,
        "prompt": prompt,
        "text": output.outputs[0].text,
        "outputs": [
            {
                "index": c.index,
                "text": c.text,
                "token_ids": c.token_ids,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                **({"logprobs": [{str(k): v for k, v in lp.items()} for lp in c.logprobs]} if c.logprobs else {}),
            }
            for c in output.outputs
        ],
        "metrics": {"ttft_s": metrics.time_to_first_token, "e2e_s": metrics.e2e_latency},
    }
    return json.dumps(record, ensure_ascii=False)


def _summary(outputs, stats, elapsed: float, block_manager) -> str:
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    overhead = 1 - stats.forward_time / stats.step_time if stats.step_time else 0.0
    lines = [
        f"requests            {len(outputs)} in {elapsed:.2f} s ({len(outputs) / elapsed:.2f} req/s)",
        f"tokens              {prompt_tokens} prompt, {generated} generated ({generated / elapsed:.1f} tok/s)",
        f"KV pool             {block_manager.num_blocks} blocks of {block_manager.block_size} tokens",
        f"peak KV use         {100 * stats.peak_kv_usage:.1f}% of the pool",
        f"preemptions         {stats.num_preemptions}",
        f"prefix-cache hits   {100 * stats.prefix_cache_hit_rate:.1f}% of prompt tokens",
        f"engine steps        {stats.num_steps}, {100 * overhead:.1f}% of step time outside the model forward",
    ]
    if stats.spec_decode_num_draft_tokens:
        lines.append(f"speculation         {stats.spec_decode_num_accepted_tokens} of "
                     f"{stats.spec_decode_num_draft_tokens} draft tokens accepted")  # fmt: skip
    return "\n".join(lines)


def run(
    engine: EngineArgs,
    input: Annotated[
        Path | None,
        typer.Option(
            "--input",
            "-i",
            exists=True,
            dir_okay=False,
            allow_dash=True,
            help="prompts: text (one per line) or JSONL; default stdin",
        ),
    ] = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="JSONL results; default stdout")] = None,
    max_tokens: Annotated[int, typer.Option(help="default max new tokens per prompt")] = 16,
    temperature: Annotated[float, typer.Option(help="default temperature (0 = greedy)")] = 0.0,
    top_p: Annotated[float, typer.Option(help="default nucleus probability")] = 1.0,
    top_k: Annotated[int, typer.Option(help="default top-k (0 = off)")] = 0,
    ignore_eos: Annotated[bool, typer.Option(help="keep generating past EOS")] = False,
    chat: Annotated[
        bool, typer.Option(help="send each prompt as a user message through the model's chat template (LLM.chat)")
    ] = False,
    progress: Annotated[bool, typer.Option(help="show a progress bar on stderr")] = True,
) -> None:
    """Offline batch generation: prompts in, JSONL results out, a throughput summary on stderr."""
    from pydantic import ValidationError

    from paged_backend.engine import LLM, SamplingParams
    from paged_backend.errors import PagedBackendError, one_line

    defaults = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, ignore_eos=ignore_eos)
    if output is not None and output.is_dir():  # said now, not after the whole run, whose results it would lose
        typer.echo(f"error: --output {output} is a folder; name a file in it, e.g. {output / 'results.jsonl'}", err=True)
        raise typer.Exit(2)
    if output is not None and not output.parent.is_dir():
        typer.echo(f"error: --output's folder {output.parent} does not exist; create it or write elsewhere", err=True)
        raise typer.Exit(2)
    try:
        text = input.read_text() if input is not None and str(input) != "-" else sys.stdin.read()
    except UnicodeDecodeError as error:
        typer.echo(f"error: --input is not UTF-8 text ({error.reason} at byte {error.start})", err=True)
        raise typer.Exit(2) from error
    records = read_prompts(text, jsonl=True if input is not None and input.suffix in (".jsonl", ".json") else None)
    try:
        params = [
            SamplingParams(**{**defaults, **{k: v for k, v in r.items() if k not in ("prompt", "priority")}})
            for r in records
        ]
        llm = LLM(**engine.engine_kwargs())
        startup.started()
        began = time.perf_counter()
        priorities = [int(r.get("priority", 0)) for r in records]
        if chat:
            conversations = [[{"role": "user", "content": r["prompt"]}] for r in records]
            outputs = llm.chat(conversations, params, priority=priorities, use_tqdm=progress)
        else:
            outputs = llm.generate([r["prompt"] for r in records], params, priority=priorities, use_tqdm=progress)
        elapsed = time.perf_counter() - began
    except (PagedBackendError, ValidationError, TypeError, ValueError) as error:  # (a line's values, e.g. priority)
        typer.echo(f"error: {one_line(error)}", err=True)
        raise typer.Exit(2) from error
    except RuntimeError as error:
        if not getattr(error, "fatal", False):
            raise
        typer.echo(f"error: {error}", err=True)  # a parallel rank failed: its workers are already stopped
        raise typer.Exit(1) from error
    llm.engine.close()
    lines = "".join(
        _result_line(i, r["prompt"], o) + "\n" for i, (r, o) in enumerate(zip(records, outputs, strict=True))
    )
    if output is None:
        sys.stdout.write(lines)
    else:
        output.write_text(lines)
    typer.echo(_summary(outputs, llm.engine.stats(), max(elapsed, 1e-9), llm.engine.block_manager), err=True)


add_engine_command(app, "run", run)


def _register_faces() -> None:
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as error:
            missing = error.name or ""
            if name.startswith(missing) or not missing.startswith("paged_backend"):
                continue  # that face, or an optional extra it needs, is not installed
            raise
        module.register(app)


_register_faces()
