"""`paged-backend launch`: text-generation-launcher's command line, serving the TGI API on a chosen backend.

paged-backend launch --model-id PATH --backend paged      # this engine, in-process (default)
paged-backend launch --model-id PATH --backend reference  # HF generate, contiguous KV (A/B baseline)
paged-backend launch --backend grpc --shard-uds-path /tmp/text-generation-server   # drive a v3 shard
paged-backend launch --backend grpc --num-shard 2   # start 2 tensor-parallel shards, drive them as one
paged-backend launch --backend paged --num-shard 2  # the engine's own tensor parallelism (2 ranks)
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import signal
import sys

from pydantic import ValidationError

from paged_backend.errors import PagedBackendError, one_line
from paged_backend.tgi.backends.lora import lora_options
from paged_backend.tgi.http.settings import ROUTER_FLAG_FIELDS, RouterSettings
from paged_backend.tgi.launcher.flags import (
    ADDED_ENGINE_FIELDS,
    ENGINE_FIELDS_FROM_TGI,
    TGI_FLAG_OF_FIELD,
    cuda_graph_sizes,
    ignored_flags,
    parse_flags,
    usage_error,
)
from paged_backend.tgi.names import kv_cache_dtype
from paged_backend.worker.default_model import served_name

logger = logging.getLogger("paged_backend.tgi")


class LaunchError(SystemExit):
    """A flag combination TGI's router would also refuse (`usage`: a usage error, exit 2, as argparse's), or a
    failure after start (exit 1). `main` prints it as one line under its prog; raised past `main`, it still exits
    with the reason."""

    def __init__(self, message: str, usage: bool = True) -> None:
        super().__init__(f"paged-backend launch: {message}")
        self.message, self.usage = message, usage


def engine_config(args: argparse.Namespace):
    """EngineConfig for `--backend paged`: TGI's flags mapped onto the engine's (`ENGINE_FIELDS_FROM_TGI`; the pool
    sized by --max-batch-total-tokens), then the engine options TGI lacks, as given."""
    from paged_backend.engine.args import EngineArgs

    num_blocks = args.num_blocks
    if num_blocks is None and args.max_batch_total_tokens is not None:
        num_blocks = math.ceil(args.max_batch_total_tokens / args.block_size) + 1  # + the reserved block 0
    # TGI flags whose value the engine takes in another form (the LoRA adapters: below).
    translated = dict(
        model=args.model_id,
        num_blocks=num_blocks,
        tensor_parallel_size=num_shards(args) or 1,
        cache_dtype=kv_cache_dtype(args.kv_cache_dtype),
        speculative_config=_speculative_config(args),
        # like TGI's CPU backends, no graphs to capture off a GPU
        max_cudagraph_capture_size=cuda_graph_max(args.cuda_graphs) if _on_gpu(args.device) else None,
        **_quantization(args),
    )
    as_given = {field: getattr(args, dest) for field, dest in ENGINE_FIELDS_FROM_TGI.items() if field != "lora_modules"}
    added = EngineArgs.from_namespace(args, ADDED_ENGINE_FIELDS).model_dump(exclude_none=True)
    config = EngineArgs(**{**as_given, **translated, **added}).to_engine_config()
    for name, value in lora_options(args.lora_adapters).items():
        if name not in added:  # TGI sizes LoRA from the adapters; an engine flag given says otherwise
            setattr(config, name, value)
    return config


def _speculative_config(args: argparse.Namespace) -> str | None:
    """--speculative-config (vLLM's JSON), or TGI's --speculate N: n-gram lookup without a Medusa/MLP head."""
    if args.speculate and args.speculative_config:
        raise LaunchError("give --speculate or --speculative-config, not both")
    if args.speculate:
        return json.dumps({"method": "ngram", "num_speculative_tokens": args.speculate})
    return args.speculative_config


def placement_flags(args: argparse.Namespace) -> dict:
    """accelerate's placement flags (device map, memory limits, offload) that were given."""
    names = ("device_map", "max_memory", "cpu_offload_gb", "offload_folder")
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def _on_gpu(device: str | None) -> bool:
    from paged_backend.worker.models import resolve_device

    return resolve_device(device or "auto").type == "cuda"


def cuda_graph_max(sizes: str | None) -> int | None:
    """TGI's `--cuda-graphs 1,2,4,8,...` (batch sizes to capture; 0: none) as the engine's largest capture size
    (the engine captures its own sizes, 1, 2, 4, 8, then multiples of 16, up to it); None when not given."""
    if sizes is None:
        return None
    try:
        return max(cuda_graph_sizes(sizes))
    except ValueError as error:
        raise LaunchError(f"--cuda-graphs takes {error}") from error


def _quantization(args: argparse.Namespace) -> dict:
    """TGI's `--quantize NAME` as EngineConfig's (quantization, quantization_param)."""
    from paged_backend.errors import InvalidRequest
    from paged_backend.worker.quantization import from_tgi

    try:
        quantization, param = from_tgi(args.quantize)
    except InvalidRequest as error:
        raise LaunchError(str(error)) from error
    return {"quantization": quantization, "quantization_param": param}


def num_shards(args: argparse.Namespace) -> int | None:
    """Shards asked for with TGI's `--num-shard` / `--sharded`; None when neither was given."""
    sharded = None if args.sharded is None else args.sharded.strip().lower() in {"1", "true", "yes"}
    count = args.num_shard
    if sharded is False and count is not None and count > 1:
        raise LaunchError("Sharding is disabled (--sharded false) but --num-shard is > 1")
    if sharded and count is None:
        import torch

        count = torch.cuda.device_count()
        if count < 2:
            raise LaunchError("--sharded needs --num-shard N here: fewer than 2 GPUs are visible to count shards on")
    if count is not None and count < 1:
        raise LaunchError(f"--num-shard must be at least 1, got {count}")
    if count is not None and count > 1 and args.backend == "reference":
        raise LaunchError("--num-shard needs --backend paged or grpc; the reference backend runs one process")
    return count


def build_backend(args: argparse.Namespace, shards=None):
    """The backend object the HTTP face drives (`shards`: the shard processes this launcher started, grpc)."""
    if args.backend == "paged":
        from paged_backend.engine import Engine
        from paged_backend.engine.async_engine import EngineThread
        from paged_backend.tgi.backends.paged import PagedBackend

        engine_thread = EngineThread()  # built where it will step, as serve's
        return PagedBackend(engine_thread.submit(lambda: Engine(engine_config(args))).result(), engine_thread)
    if args.backend == "reference":
        from paged_backend.tgi.backends.reference import ReferenceBackend
        from paged_backend.worker.models import load_model

        model, tokenizer = load_model(
            args.model_id, tokenizer=args.tokenizer_name, dtype=args.dtype or "auto",
            device=args.device, trust_remote_code=args.trust_remote_code, **placement_flags(args), **_quantization(args),
        )  # fmt: skip
        max_positions = getattr(model.config.get_text_config(), "max_position_embeddings", 2048)
        return ReferenceBackend(model, tokenizer, max_positions)
    from paged_backend.tgi.router.backend import GrpcBackend

    return GrpcBackend.from_flags(args, shards_ready=None if shards is None else shards.wait_ready)


def _check_input_within_total(max_input: int, max_total: int) -> None:
    if max_input >= max_total:
        raise LaunchError(
            f"`max_input_tokens` must be < `max_total_tokens`. Given: {max_input} and {max_total}; "
            "lower --max-input-tokens or raise --max-total-tokens"
        )


def router_settings(args: argparse.Namespace, max_model_len: int) -> RouterSettings:
    """Limits with TGI's defaults and its startup checks."""
    max_total = args.max_total_tokens or max_model_len
    max_input = args.max_input_tokens if args.max_input_tokens is not None else max_total - 1
    _check_input_within_total(max_input, max_total)
    if max_total > max_model_len:
        raise LaunchError(
            f"`max_total_tokens` ({max_total}) exceeds what the backend holds ({max_model_len}); "
            "lower --max-total-tokens"
        )
    return RouterSettings(
        model_id=served_name(args.model_id),
        max_input_tokens=max_input,
        max_total_tokens=max_total,
        **{name: getattr(args, name) for name in ROUTER_FLAG_FIELDS},
    )


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None, prog: str = "paged-backend launch") -> None:
    """Parse TGI flags, build the backend, serve until interrupted. A refused flag exits 2 with one line."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_flags(sys.argv[1:] if argv is None else argv, prog)
    try:
        _launch(args)
    except LaunchError as error:
        if not error.usage:
            raise SystemExit(f"{prog}: {error.message}") from None
        sys.stderr.write(usage_error(prog, error.message) + "\n")
        raise SystemExit(2) from None


def _launch(args: argparse.Namespace) -> None:
    import uvicorn

    from paged_backend.observability.tracing import otlp_tracer
    from paged_backend.tgi.http.app import create_app

    ignored = ignored_flags(args)
    if ignored:
        logger.warning("ignoring %s: no meaning for --backend %s", ", ".join(ignored), args.backend)
    count = num_shards(args)
    if args.max_input_tokens is not None and args.max_total_tokens is not None:  # refused before a model loads
        _check_input_within_total(args.max_input_tokens, args.max_total_tokens)
    shards = None
    if args.backend == "grpc" and count is not None:  # TGI's layout: this launcher starts the shards itself
        from paged_backend.tgi.launcher.shard_processes import ShardProcesses

        shards = ShardProcesses(args, count)
        # uvicorn re-raises the SIGTERM it caught once it has shut down; as an exception it still runs `finally`.
        signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        try:
            backend = build_backend(args, shards)
        except (PagedBackendError, ValidationError) as error:  # a model it cannot run, a value out of range
            speculate = {"speculative_config": "--speculate"} if args.speculate else {}  # TGI's flag set it
            raise LaunchError(one_line(error, {**TGI_FLAG_OF_FIELD, **speculate})) from error
        settings = router_settings(args, backend.max_model_len)
        try:
            tracer = otlp_tracer(args.otlp_endpoint, args.otlp_service_name) if args.otlp_endpoint else None
        except RuntimeError as error:  # the [otel] extra is missing, or an unknown OTLP protocol
            raise LaunchError(f"--otlp-endpoint: {error}") from error
        app = create_app(backend, settings, drain_timeout=float(args.graceful_termination_timeout), tracer=tracer)
        logger.info("TGI API on %s:%d, backend %s, model %s", args.hostname, args.port, backend.name, settings.model_id)
        uvicorn.run(app, host=args.hostname, port=args.port, log_level="warning", timeout_graceful_shutdown=5)
    finally:
        if shards is not None:
            shards.stop()
            if shards.failure:
                raise LaunchError(shards.failure, usage=False)
