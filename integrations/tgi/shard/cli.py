"""`text-generation-server` (alias `paged-backend-shard`): TGI's shard command line on this project's core.

    text-generation-server serve MODEL_ID --uds-path /tmp/text-generation-server   # what TGI's launcher runs
    text-generation-server download-weights MODEL_ID

Flags TGI's launcher passes but that change nothing here are accepted and reported once. Our additions:
`--num-blocks` (KV pool size; default: memory budget) and `--device` (env PAGED_BACKEND_DEVICE).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Annotated

import typer

from paged_backend.config.env import env_flag, env_fraction
from paged_backend.startup import quiet_start, started
from paged_backend.tgi.names import kv_cache_dtype as kv_cache_dtype_from_tgi
from paged_backend.worker.default_model import TINY_MODEL

app = typer.Typer(help="generate.v3 gRPC shard (text-generation-server compatible) on paged-backend.")
logger = logging.getLogger("paged_backend.tgi.shard")

Opt = typer.Option


@app.command()
@quiet_start()  # started() once the model is built
def serve(
    model_id: str,
    revision: Annotated[str | None, Opt(help="hub revision (ignored)")] = None,
    sharded: Annotated[
        bool, Opt("--sharded/--no-sharded", help="tensor parallelism: one shard per rank (RANK, WORLD_SIZE, MASTER_*)")
    ] = False,
    quantize: Annotated[
        str | None, Opt(help="awq | gptq | bitsandbytes[-nf4|-fp4] | fp8 | eetq | marlin | exl2 | torchao")
    ] = None,
    speculate: Annotated[int | None, Opt(help="speculative decoding (ignored)")] = None,
    dtype: Annotated[str | None, Opt(help="float16 | bfloat16 | float32")] = None,
    kv_cache_dtype: Annotated[str | None, Opt(help="fp8_e4m3fn | fp8_e5m2 | float16 | bfloat16 | float32")] = None,
    trust_remote_code: Annotated[bool, Opt(help="run the model's own code (a checkpoint that ships modeling files)")] = False,
    uds_path: Annotated[
        str, Opt(help="socket prefix; this shard binds {uds_path}-{rank}")
    ] = "/tmp/text-generation-server",
    logger_level: Annotated[str, Opt(help="log level")] = "INFO",
    json_output: Annotated[bool, Opt(help="JSON logs (ignored)")] = False,
    otlp_endpoint: Annotated[str | None, Opt(help="OpenTelemetry (ignored)")] = None,
    otlp_service_name: Annotated[str, Opt(help="OpenTelemetry (ignored)")] = "text-generation-inference.server",
    max_input_tokens: Annotated[int | None, Opt(help="used by chunking shards (ignored)")] = None,
    num_blocks: Annotated[int | None, Opt(help="KV pool size in blocks (default: memory budget)")] = None,
    device: Annotated[str, Opt(envvar="PAGED_BACKEND_DEVICE", help="auto | cpu | cuda | cuda:N")] = "auto",
) -> None:
    """Serve TextGenerationService for MODEL_ID on a unix socket."""
    from paged_backend.errors import InvalidRequest, PagedBackendError
    from paged_backend.tgi.shard import tensor_parallel
    from paged_backend.tgi.shard.model import ShardModel
    from paged_backend.tgi.shard.server import serve as serve_shard
    from paged_backend.worker.models import resolve_device
    from paged_backend.worker.quantization import from_tgi

    logging.basicConfig(level=logger_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        rank = tensor_parallel.shard_rank(sharded)
    except InvalidRequest as error:
        raise typer.BadParameter(str(error)) from error
    device = tensor_parallel.rank_device(device, rank)
    if rank.world_size > 1:
        tensor_parallel.join_group(rank, resolve_device(device))
    given = {
        "--revision": revision,
        "--speculate": speculate,
        "--json-output": json_output or None,
        "--otlp-endpoint": otlp_endpoint,
        "--max-input-tokens": max_input_tokens,
    }
    ignored = [name for name, value in given.items() if value is not None]
    if os.environ.get("ATTENTION", "paged") != "paged":
        ignored.append(f"ATTENTION={os.environ['ATTENTION']} (this shard always runs paged attention)")
    if ignored:
        logger.warning("ignoring %s: no meaning for the paged-backend shard", ", ".join(ignored))
    try:
        # TGI's launcher exports PREFIX_CACHING; with it the router's radix allocator sends cache_len > 0.
        prefix_caching = env_flag("PREFIX_CACHING", False)
        quantization, quantization_param = from_tgi(quantize)
        model = ShardModel(
            model_id,
            quantization=quantization,
            quantization_param=quantization_param,
            dtype=dtype or "auto",
            device=device,
            kv_cache_dtype=kv_cache_dtype_from_tgi(kv_cache_dtype),
            num_blocks=num_blocks,
            memory_fraction=env_fraction("CUDA_MEMORY_FRACTION", 1.0),
            rank=rank,
            trust_remote_code=trust_remote_code,
        )
    except PagedBackendError as error:  # a model or format this machine cannot run, a bad environment value
        raise typer.BadParameter(str(error)) from error
    started()
    asyncio.run(
        serve_shard(model, uds_path, rank=rank.rank, world_size=rank.world_size, use_prefix_caching=prefix_caching)
    )
    logger.info("shard %d stopped", rank.rank)
    if rank.world_size > 1:
        tensor_parallel.leave_group()
        # Nothing is left to release; skip the interpreter's module teardown (seconds with torch loaded), so a
        # launcher stopping N shards is not kept waiting.
        logging.shutdown()
        os._exit(0)


@app.command("download-weights")
def download_weights(
    model_id: str,
    revision: Annotated[str | None, Opt(help="hub revision")] = None,
    extension: Annotated[str, Opt(help="weight file extension")] = ".safetensors",
    auto_convert: Annotated[bool, Opt(help="convert .bin to safetensors (ignored)")] = True,
    logger_level: Annotated[str, Opt(help="log level")] = "INFO",
    json_output: Annotated[bool, Opt(help="JSON logs (ignored)")] = False,
    trust_remote_code: Annotated[bool, Opt(help="(ignored)")] = False,
    merge_lora: Annotated[bool, Opt(help="(ignored)")] = False,
) -> None:
    """Fetch MODEL_ID's weights and tokenizer into the hub cache (nothing to do for local or embedded models)."""
    logging.basicConfig(level=logger_level.upper())
    if model_id == TINY_MODEL or os.path.exists(os.path.expanduser(model_id)):
        logger.info("%s is local: nothing to download", model_id)
        return
    from huggingface_hub import snapshot_download

    patterns = [f"*{extension}", "*.json", "*.model", "*.txt", "*.tiktoken"]
    snapshot_download(model_id, revision=revision, allow_patterns=patterns)
