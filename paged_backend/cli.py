"""`paged-backend` command line: `version` and `run` here; `serve`, `launch`, `dashboards` and `bench` register from
their own modules."""

from __future__ import annotations

import importlib
import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from paged_backend.engine import args as engine_args

app = typer.Typer(help="paged-backend: paged KV cache + continuous batching", no_args_is_help=True)

# Modules that add their own subcommands through `register(app)`; one whose extra is not installed is skipped.
COMMAND_MODULES = (
    "paged_backend.server.cli",
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


def _result_line(index: int, output) -> str:
    metrics = output.metrics
    record = {
        "index": index,
        "prompt": output.prompt,
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


def _summary(outputs, stats, elapsed: float) -> str:
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    overhead = 1 - stats.forward_time / stats.step_time if stats.step_time else 0.0
    lines = [
        f"requests            {len(outputs)} in {elapsed:.2f} s ({len(outputs) / elapsed:.2f} req/s)",
        f"tokens              {prompt_tokens} prompt, {generated} generated ({generated / elapsed:.1f} tok/s)",
        f"peak KV use         {100 * stats.peak_kv_usage:.1f}% of the pool",
        f"preemptions         {stats.num_preemptions}",
        f"prefix-cache hits   {100 * stats.prefix_cache_hit_rate:.1f}% of prompt tokens",
        f"engine steps        {stats.num_steps}, {100 * overhead:.1f}% of step time outside the model forward",
    ]
    if stats.spec_decode_num_draft_tokens:
        lines.append(f"speculation         {stats.spec_decode_num_accepted_tokens} of "
                     f"{stats.spec_decode_num_draft_tokens} draft tokens accepted")  # fmt: skip
    return "\n".join(lines)


@app.command()
def run(
    input: Annotated[
        Path | None, typer.Option("--input", "-i", help="prompts: text (one per line) or JSONL; default stdin")
    ] = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="JSONL results; default stdout")] = None,
    model: Annotated[str | None, typer.Option(help="local directory or hub id; omit for the embedded tiny model")] = None,
    tokenizer: Annotated[str | None, typer.Option(help="tokenizer directory or id; default: the model's")] = None,
    block_size: Annotated[int | None, typer.Option(help="tokens per KV block (power of two, 1..256)")] = None,
    num_blocks: Annotated[int | None, typer.Option(help="KV pool size in blocks; overrides the memory budget")] = None,
    gpu_memory_utilization: Annotated[float | None, typer.Option(help="fraction of free GPU memory for KV")] = None,
    max_num_seqs: Annotated[int | None, typer.Option(help="most sequences in one step")] = None,
    max_num_batched_tokens: Annotated[int | None, typer.Option(help="most tokens in one step")] = None,
    max_model_len: Annotated[int | None, typer.Option(help="longest prompt + output")] = None,
    swap_space: Annotated[float | None, typer.Option(help="GiB of CPU memory for swapped-out KV blocks")] = None,
    enable_prefix_caching: Annotated[
        bool | None, typer.Option("--enable-prefix-caching/--no-enable-prefix-caching", help="reuse prompt blocks")
    ] = None,
    enable_chunked_prefill: Annotated[
        bool | None, typer.Option("--enable-chunked-prefill/--no-enable-chunked-prefill", help="split long prompts")
    ] = None,
    policy: Annotated[str | None, typer.Option(help="fcfs | priority (JSONL 'priority' field)")] = None,
    dtype: Annotated[str | None, typer.Option(help="auto | float32 | float16 | bfloat16")] = None,
    device: Annotated[str | None, typer.Option(help="auto | cpu | cuda | cuda:N")] = None,
    seed: Annotated[int | None, typer.Option(help="engine seed for unseeded sampling")] = None,
    device_map: engine_args.DeviceMap = None,
    max_memory: engine_args.MaxMemory = None,
    cpu_offload_gb: engine_args.CpuOffloadGb = None,
    offload_folder: engine_args.OffloadFolder = None,
    quantization: engine_args.Quantization = None,
    quantization_param: engine_args.QuantizationParam = None,
    kv_cache_dtype: engine_args.KvCacheDtype = None,
    calculate_kv_scales: engine_args.CalculateKvScales = None,
    speculative_config: engine_args.SpeculativeConfigJson = None,
    enforce_eager: engine_args.EnforceEager = False,
    max_tokens: Annotated[int, typer.Option(help="default max new tokens per prompt")] = 16,
    temperature: Annotated[float, typer.Option(help="default temperature (0 = greedy)")] = 0.0,
    top_p: Annotated[float, typer.Option(help="default nucleus probability")] = 1.0,
    top_k: Annotated[int, typer.Option(help="default top-k (0 = off)")] = 0,
    ignore_eos: Annotated[bool, typer.Option(help="keep generating past EOS")] = False,
    progress: Annotated[bool, typer.Option(help="show a progress bar on stderr")] = True,
    tensor_parallel_size: engine_args.TensorParallelSize = None,
    pipeline_parallel_size: engine_args.PipelineParallelSize = None,
    distributed_executor_backend: engine_args.DistributedExecutorBackend = None,
    distributed_timeout_seconds: engine_args.DistributedTimeoutSeconds = None,
) -> None:
    """Offline batch generation: prompts in, JSONL results out, a throughput summary on stderr."""
    from pydantic import ValidationError

    from paged_backend.engine import LLM, SamplingParams
    from paged_backend.errors import PagedBackendError

    flags = dict(
        model=model, tokenizer=tokenizer, block_size=block_size, num_blocks=num_blocks,
        gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len, swap_space=swap_space,
        enable_prefix_caching=enable_prefix_caching, enable_chunked_prefill=enable_chunked_prefill, policy=policy,
        dtype=dtype, device=device, seed=seed, device_map=device_map, max_memory=max_memory,
        cpu_offload_gb=cpu_offload_gb, offload_folder=offload_folder, tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size, distributed_executor_backend=distributed_executor_backend,
        distributed_timeout_seconds=distributed_timeout_seconds, quantization=quantization,
        quantization_param=quantization_param, cache_dtype=kv_cache_dtype, calculate_kv_scales=calculate_kv_scales,
        speculative_config=speculative_config, enforce_eager=enforce_eager or None,
    )  # fmt: skip
    defaults = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, ignore_eos=ignore_eos)
    text = input.read_text() if input is not None and str(input) != "-" else sys.stdin.read()
    records = read_prompts(text, jsonl=True if input is not None and input.suffix in (".jsonl", ".json") else None)
    try:
        params = [SamplingParams(**{**defaults, **{k: v for k, v in r.items() if k not in ("prompt", "priority")}})
                  for r in records]
        llm = LLM(**{k: v for k, v in flags.items() if v is not None})
        started = time.perf_counter()
        priorities = [int(r.get("priority", 0)) for r in records]
        outputs = llm.generate([r["prompt"] for r in records], params, priority=priorities, use_tqdm=progress)
        elapsed = time.perf_counter() - started
    except (PagedBackendError, ValidationError, TypeError) as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from error
    except RuntimeError as error:
        if not getattr(error, "fatal", False):
            raise
        typer.echo(f"error: {error}", err=True)  # a parallel rank failed: its workers are already stopped
        raise typer.Exit(1) from error
    llm.engine.close()
    lines = "".join(_result_line(i, o) + "\n" for i, o in enumerate(outputs))
    if output is None:
        sys.stdout.write(lines)
    else:
        output.write_text(lines)
    typer.echo(_summary(outputs, llm.engine.stats(), max(elapsed, 1e-9)), err=True)


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
