"""What an engine runs on: the model and tokenizer, its KV pool and block manager, the model runner (or the parallel
driver's), and the longest sequence the pool holds. `assemble` builds them from an `EngineConfig`."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from paged_backend.config import EngineConfig
from paged_backend.config.env import env_flag
from paged_backend.core.block_manager import BlockManager
from paged_backend.core.kv_budget import KVShape
from paged_backend.core.kv_cache import PagedKVCache
from paged_backend.errors import InvalidRequest
from paged_backend.lora import LoRAManager
from paged_backend.worker.batch_invariant import refusal
from paged_backend.worker.model_support import check_runs_paged
from paged_backend.worker.model_worker import ModelWorker, plan_pool
from paged_backend.worker.models import load_configured
from paged_backend.worker.offload import input_device
from paged_backend.worker.runner import ModelRunner

ALLOW_LONG_ENV = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"  # vLLM's: =1 lets max_model_len pass the model's positions


@dataclass
class EngineParts:
    """The assembled pieces an `Engine` steps with."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    kv_cache: PagedKVCache
    block_manager: BlockManager
    runner: ModelRunner
    lora: LoRAManager | None  # with enable_lora: the adapters' registry and device slots
    parallel: object | None  # the ParallelDriver of a TP x PP engine, else None
    device: torch.device
    backend: str | None  # the attention backend asked for; None = automatic
    max_model_len: int
    prefill_chunk_limit: int


def assemble(
    config: EngineConfig, model: PreTrainedModel | None = None, tokenizer: PreTrainedTokenizerBase | None = None
) -> EngineParts:
    """Load the model (unless given one, with its tokenizer), size and allocate the pool, build the runner."""
    loaded = model is None
    if loaded:
        model, tokenizer = load_configured(config)
    elif tokenizer is None:
        raise InvalidRequest("a model object was given without its tokenizer; pass tokenizer=...")
    if config.lora_modules and not config.enable_lora:
        raise InvalidRequest("lora_modules were given but LoRA is disabled; set enable_lora=True (--enable-lora)")
    check_runs_paged(model)
    device = input_device(model)  # accelerate-dispatched models: each layer's KV on its own device
    backend = None if config.attention_backend == "auto" else config.attention_backend
    if config.batch_invariant and (reason := refusal(config, device)):
        raise InvalidRequest(reason)
    cache = config.cache
    parallel = lora = None
    if config.parallel.world_size > 1:  # rank 0 of a TP x PP group: its shard, its per-rank pool, the workers
        if cache.calculate_kv_scales:
            raise InvalidRequest("calculate_kv_scales runs in one process only; drop it or use tensor/pipeline size 1")
        from paged_backend.distributed.driver import ParallelDriver  # torch.distributed, only when asked for

        if not loaded:  # the driver shards its model in place: never the caller's object
            model = copy.deepcopy(model)
        parallel = ParallelDriver(config, model)
        model, kv_cache = parallel.model, parallel.kv_cache
        if config.enable_lora:
            lora = LoRAManager.for_engine(config, model, parallel)
        runner = parallel.runner(backend, lora)
    else:
        # Sliding-window layers get their own block tables unless the hybrid manager is off.
        split = not config.scheduler.disable_hybrid_kv_cache_manager
        plan = plan_pool(model, cache, device, split_windows=split, backend=config.attention_backend)
        # The runner switches attention to "paged_backend" (and eval mode) for its own forwards only: a model object
        # the caller passed in is left as it was, usable with plain generate() between and after steps; it also
        # keeps its dense weights (only a model loaded here gives them up for the prepacked ones).
        worker = ModelWorker(model, plan, device, backend=backend, pack=config.prepack_weights, release=loaded,
                             calibrate=cache.calculate_kv_scales, batch_invariant=config.batch_invariant)  # fmt: skip
        kv_cache, runner = worker.kv_cache, worker.runner
        if config.enable_lora:
            lora = LoRAManager.for_engine(config, model)
    block_manager = BlockManager(
        kv_cache.num_blocks, cache.block_size, enable_prefix_caching=cache.enable_prefix_caching,
        watermark=cache.watermark, num_cpu_blocks=kv_cache.num_cpu_blocks,
        sliding_windows=[group.sliding_window for group in kv_cache.groups],
    )  # fmt: skip
    max_model_len = _max_model_len(config, block_manager, KVShape.of(model.config).max_positions)
    if decode_graphs_asked(config) and (reason := decode_graphs_refusal(device, kv_cache, lora, parallel)):
        raise InvalidRequest(f"CUDA graphs (max_cudagraph_capture_size={config.max_cudagraph_capture_size}) "
                             f"{reason}; drop --max-cudagraph-capture-size (TGI's --cuda-graphs)")  # fmt: skip
    attach_decode_graphs(config, runner, kv_cache, max_model_len)
    if runner.decode_graphs is not None:
        runner.decode_graphs.capture_all()  # at startup, as vLLM does: no decode step waits for a capture
    return EngineParts(
        model, tokenizer, kv_cache, block_manager, runner, lora, parallel, device, backend, max_model_len,
        _prefill_chunk_limit(config, block_manager, max_model_len),
    )  # fmt: skip


def decode_graphs_asked(config: EngineConfig) -> bool:
    return config.max_cudagraph_capture_size > 0 and not config.enforce_eager


def decode_graphs_refusal(device: torch.device, kv_cache: PagedKVCache, lora, parallel) -> str | None:
    """Why decode steps cannot replay CUDA graphs here, or None."""
    if device.type != "cuda":
        return f"need a CUDA device, not {device.type}"
    if parallel is not None:
        return "do not run with tensor or pipeline parallelism yet"
    if lora is not None:
        return "do not run with LoRA yet (a step's adapter slots are set from the host)"
    if len(kv_cache.groups) > 1:
        return "do not run with sliding-window layer groups yet (one block table per sequence)"
    return None


def attach_decode_graphs(config: EngineConfig, runner: ModelRunner, kv_cache: PagedKVCache, max_model_len: int) -> None:
    """Give `runner` decode graphs for up to `max_cudagraph_capture_size` sequences (at most `max_num_seqs`) of
    up to `max_model_len` tokens; no-op when the config asks for none."""
    if decode_graphs_asked(config):
        max_batch = min(config.max_cudagraph_capture_size, config.scheduler.max_num_seqs)
        runner.use_decode_graphs(max_batch, -(-max_model_len // kv_cache.block_size))


def _max_model_len(config: EngineConfig, manager: BlockManager, max_positions: int) -> int:
    """The longest sequence the pool holds on its own, as one sequence must to be scheduled again after a
    recompute preemption re-prefills it. Full-attention groups hold every token; windowed groups only their
    window plus a step's chunk, so a model windowed everywhere is bounded by positions, not by the pool (its
    prefill chunks then shrink to fit, see `_prefill_chunk_limit`); unchunked, one step's budget also bounds it."""
    scheduler, asked = config.scheduler, config.scheduler.max_model_len
    chunked = scheduler.enable_chunked_prefill
    capacity = _largest(lambda n: manager.fits_alone(n, 1 if chunked else n), max(max_positions, asked or 0))
    if not scheduler.enable_chunked_prefill:
        capacity = min(capacity, scheduler.max_num_batched_tokens)
    if asked is not None and asked > capacity:
        raise InvalidRequest(
            f"max_model_len={asked} needs {manager.peak_blocks_per_sequence(asked, 1)} KV blocks for one "
            f"sequence, but the pool has {manager.usable_blocks} usable blocks of {manager.block_size} tokens "
            f"({manager.num_groups} layer group(s)), so it holds at most {capacity} tokens: raise num_blocks / "
            f"kv_cache_memory_bytes / gpu_memory_utilization, or lower max_model_len to {capacity}"
        )
    if asked is not None and asked > max_positions and not env_flag(ALLOW_LONG_ENV, False):
        raise InvalidRequest(
            f"max_model_len={asked} is longer than the model's context ({max_positions} positions, its config's "
            f"max_position_embeddings): lower max_model_len to {max_positions} or less, or set {ALLOW_LONG_ENV}=1 "
            f"to run past the positions the model was trained on"
        )
    return min(asked or max_positions, capacity)


def _prefill_chunk_limit(config: EngineConfig, manager: BlockManager, max_model_len: int) -> int:
    """The largest prefill chunk with which a `max_model_len` sequence still fits the pool on its own: the whole
    step budget unless windowed groups, which hold a chunk's worth of blocks, need smaller chunks."""
    budget = config.scheduler.max_num_batched_tokens
    if not config.scheduler.enable_chunked_prefill:
        return budget
    return _largest(lambda chunk: manager.fits_alone(max_model_len, chunk), budget)


def _largest(fits, high: int) -> int:
    """The largest n in 1..high with fits(n), for a monotone `fits` (0 if none)."""
    low = 0
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low
