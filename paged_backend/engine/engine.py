"""Engine (add_request / step / abort_request) and LLM (offline generate) over any HF causal LM."""

from __future__ import annotations

import copy
import itertools
import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from paged_backend.core.block_manager import BlockManager
from paged_backend.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from paged_backend.worker.packed_linear import pack_linears
from paged_backend.engine.prompt_logprobs import prompt_logprob_rows, record_prompt_logprobs
from paged_backend.engine.request import Request, RequestOutput, SamplingParams, Sequence, SequenceStatus
from paged_backend.worker.runner import ModelRunner
from paged_backend.engine.sampler import Sampler
from paged_backend.engine.scheduler import Scheduler
from paged_backend.errors import InvalidRequest, PromptTooLong
from paged_backend.core.kv_cache import (
    PagedKVCache,
    available_memory,
    bytes_per_block,
    check_kv_dtype_runs,
    num_blocks_for_budget,
    resolve_kv_dtype,
)
from paged_backend.core.kv_groups import kv_cache_groups, sliding_windows
from paged_backend.core.kv_scales import start_calibration
from paged_backend.core.kv_snapshot import KVHistory, pool_snapshot
from paged_backend.lora import LoRAManager, LoRARequest
from paged_backend.worker.model_support import check_runs_paged
from paged_backend.worker.models import load_model
from paged_backend.worker.offload import input_device, layer_devices

CPU_DEFAULT_KV_BYTES = 512 << 20  # on CPU "free memory" is the whole machine: default to 512 MiB (or 10%)


@dataclass(frozen=True)
class EngineStats:
    """Counters a server exports; usage figures are fractions in [0, 1]."""

    num_running: int
    num_waiting: int
    num_swapped: int
    kv_usage: float
    peak_kv_usage: float
    num_preemptions: int
    num_split_prefills: int
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # prompt tokens found cached
    prompt_tokens: int
    generation_tokens: int
    num_steps: int
    step_time: float  # seconds inside step()
    forward_time: float  # seconds inside the model forward
    running_lora_adapters: tuple[str, ...] = ()  # adapters of running / waiting requests (vLLM's lora_requests_info)
    waiting_lora_adapters: tuple[str, ...] = ()
    # Speculative decoding (vLLM's names): proposals verified, tokens proposed, accepted, accepted per position.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


def _model_shape(config) -> tuple[int, int, int, int]:
    """(layers, kv heads, head dim, max positions) of a causal LM config."""
    config = config.get_text_config()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return config.num_hidden_layers, kv_heads, head_dim, getattr(config, "max_position_embeddings", 2048)


class Engine:
    """Continuous-batching engine: add requests, call `step()` until done, read cumulative outputs.

    >>> engine = Engine(EngineConfig(device="cpu", cache=CacheConfig(num_blocks=64)))
    >>> engine.add_request("a", "Hello", SamplingParams(temperature=0, max_tokens=4))
    >>> while engine.has_unfinished_requests():
    ...     outputs = engine.step()
    >>> len(outputs[0].outputs[0].token_ids)
    4
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        model: PreTrainedModel | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> None:
        self.config = config = config or EngineConfig()
        loaded = model is None
        if loaded:
            model, tokenizer = load_model(
                config.model, tokenizer=config.tokenizer, dtype=config.dtype, device=config.device,
                device_map=config.device_map, max_memory=config.max_memory, cpu_offload_gb=config.cpu_offload_gb,
                offload_folder=config.offload_folder, quantization=config.quantization,
                quantization_param=config.quantization_param,
            )  # fmt: skip
        elif tokenizer is None:
            raise InvalidRequest("a model object was given without its tokenizer; pass tokenizer=...")
        check_runs_paged(model)
        cache = config.cache
        num_layers, kv_heads, head_dim, max_positions = _model_shape(model.config)
        device = input_device(model)  # accelerate-dispatched models: each layer's KV on its own device
        # Sliding-window layers get their own block tables; a block holds one group's layers (its "slots").
        windows = sliding_windows(model.config.get_text_config())
        if config.scheduler.disable_hybrid_kv_cache_manager or config.parallel.world_size > 1:
            windows = (None,) * len(windows)  # windowed layers kept whole, as full ones are (ranks pool one group)
        groups = kv_cache_groups(windows)
        kv_dtype = resolve_kv_dtype(cache.cache_dtype, model.dtype)
        check_kv_dtype_runs(kv_dtype, device, config.attention_backend)
        if cache.calculate_kv_scales and config.parallel.world_size > 1:
            raise InvalidRequest("calculate_kv_scales runs in one process only; drop it or use tensor/pipeline size 1")
        self.parallel = None
        if config.parallel.world_size > 1:  # rank 0 of a TP x PP group: its shard, its per-rank pool, the workers
            from paged_backend.distributed.driver import ParallelDriver

            if not loaded:  # the driver shards its model in place: never the caller's object
                model = copy.deepcopy(model)
            self.parallel = ParallelDriver(config, model)
            model, self.kv_cache = self.parallel.model, self.parallel.kv_cache
        else:
            num_slots = len(groups[0].layers)
            num_blocks, num_cpu_blocks = kv_pool_blocks(cache, num_slots, kv_heads, head_dim, kv_dtype, device)
            self.kv_cache = PagedKVCache(
                num_layers, kv_heads, head_dim, num_blocks, cache.block_size,
                dtype=kv_dtype, device=device, num_cpu_blocks=num_cpu_blocks, groups=groups,
                layer_devices=layer_devices(model, num_layers),
            )
            if cache.calculate_kv_scales:
                start_calibration(self.kv_cache)
        # The runner switches attention to "paged_backend" (and eval mode) for its own forwards only: a model
        # object the caller passed in is left as it was, usable with plain generate() between and after steps.
        self.model, self.tokenizer = model, tokenizer
        num_blocks = self.kv_cache.num_blocks
        num_cpu_blocks = self.kv_cache.cpu_kvs[0].shape[2] if self.kv_cache.cpu_kvs else 0
        self.block_manager = BlockManager(
            num_blocks, cache.block_size, enable_prefix_caching=cache.enable_prefix_caching,
            watermark=cache.watermark, num_cpu_blocks=num_cpu_blocks,
            sliding_windows=[group.sliding_window for group in groups],
        )
        self.max_model_len = self._max_model_len(config, max_positions)
        mode = config.scheduler.preemption_mode or ("swap" if num_cpu_blocks else "recompute")
        self.scheduler = Scheduler(config.scheduler, self.block_manager, mode, self._prefill_chunk_limit(config))
        backend = None if config.attention_backend == "auto" else config.attention_backend
        if self.parallel is None:
            packed = pack_linears(model, config.prepack_weights, release=loaded)  # a caller's model keeps its own
            self.runner = ModelRunner(model, self.kv_cache, self.block_manager, backend, packed)
        else:
            self.runner = self.parallel.runner(self.block_manager, backend)
        self.lora = None
        if config.enable_lora:
            self.lora = LoRAManager.for_engine(config, model, self.runner, self.scheduler, self.parallel)
        if config.lora_modules and self.lora is None:
            raise InvalidRequest("lora_modules were given but LoRA is disabled; set enable_lora=True (--enable-lora)")
        from paged_backend.spec_decode.speculator import build_speculator  # it imports engine modules itself

        self.speculator = build_speculator(self, backend)
        self.eos_token_ids = self._eos_token_ids()
        self.sampler = Sampler(self.eos_token_ids, seed=config.seed, device=device)
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._counters = dict(prompt_tokens=0, generation_tokens=0, num_steps=0, step_time=0.0, forward_time=0.0)
        self._peak_kv_usage = 0.0
        self.kv_history = KVHistory()  # usage and waste of recent steps, for the KV map

    def _max_model_len(self, config: EngineConfig, max_positions: int) -> int:
        """The longest sequence the pool holds on its own, as one sequence must to be scheduled again after a
        recompute preemption re-prefills it. Full-attention groups hold every token; windowed groups only their
        window plus a step's chunk, so a model windowed everywhere is bounded by positions, not by the pool (its
        prefill chunks then shrink to fit, see `_prefill_chunk_limit`); unchunked, one step's budget also bounds it."""
        manager, scheduler, asked = self.block_manager, config.scheduler, config.scheduler.max_model_len
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
        return min(asked or max_positions, capacity)

    def _prefill_chunk_limit(self, config: EngineConfig) -> int:
        """The largest prefill chunk with which a `max_model_len` sequence still fits the pool on its own: the whole
        step budget unless windowed groups, which hold a chunk's worth of blocks, need smaller chunks."""
        budget = config.scheduler.max_num_batched_tokens
        if not config.scheduler.enable_chunked_prefill:
            return budget
        return _largest(lambda chunk: self.block_manager.fits_alone(self.max_model_len, chunk), budget)

    def close(self) -> None:
        """Stop the worker ranks of a parallel engine (a no-op for one process); idempotent."""
        if self.parallel is not None:
            self.parallel.close()

    @staticmethod
    def _num_blocks(cache: CacheConfig, shape: tuple, device: torch.device) -> int:
        if cache.num_blocks is not None:
            return cache.num_blocks
        memory_bytes = cache.kv_cache_memory_bytes
        if memory_bytes is None and device.type != "cuda":
            memory_bytes = min(CPU_DEFAULT_KV_BYTES, available_memory(device) // 10)
        if memory_bytes is not None:
            return num_blocks_for_budget(*shape, memory_bytes=memory_bytes)
        return num_blocks_for_budget(*shape, memory_fraction=cache.gpu_memory_utilization, device=device)

    def _eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (self.tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None)):
            if source is not None:
                ids.update(source if isinstance(source, list) else [source])
        return ids

    # ------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request. Bad input raises `InvalidRequest` / `PromptTooLong` at once and queues nothing.

        `lora_request` runs the request with that adapter (loaded here, before anything is queued)."""
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use; give each request a unique id")
        params = sampling_params or SamplingParams()
        if params.num_sequences > self.config.scheduler.max_num_seqs:
            raise InvalidRequest(f"n={params.num_sequences} (best_of included) exceeds max_num_seqs="
                                 f"{self.config.scheduler.max_num_seqs}; lower n / best_of or raise max_num_seqs")
        if prompt_token_ids is None:
            if prompt is None:
                raise InvalidRequest("give a prompt or prompt_token_ids")
            prompt_token_ids = self.tokenizer(prompt).input_ids
        prompt_token_ids = list(prompt_token_ids)
        if params.truncate_prompt_tokens is not None:
            prompt_token_ids = prompt_token_ids[-params.truncate_prompt_tokens :]
        if not prompt_token_ids:
            raise InvalidRequest("prompt is empty; give at least one token of prompt")
        vocab = self.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidRequest(f"prompt_token_ids must be integers in [0, {vocab})")
        for name, ids in (("allowed_token_ids", params.allowed_token_ids), ("logit_bias", params.logit_bias)):
            if ids is not None and not all(0 <= t < vocab for t in ids):
                raise InvalidRequest(f"{name} must name token ids in [0, {vocab})")
        # Compiling the constraint here refuses a bad one before anything is queued.
        grammar = None if params.structured_outputs is None else self._structured().new_matcher(params.structured_outputs)
        if len(prompt_token_ids) >= self.max_model_len:
            raise PromptTooLong(
                f"prompt has {len(prompt_token_ids)} tokens but max_model_len is {self.max_model_len} "
                f"(prompt plus at least one generated token): shorten the prompt or raise max_model_len, the KV "
                f"pool, or (without chunked prefill) max_num_batched_tokens"
            )
        adapter = self._lora_adapter(lora_request)
        request = Request(request_id, prompt, prompt_token_ids, params, priority, next(self._arrivals))
        request.lora_adapter = adapter
        request.bad_words_token_ids = self._bad_words_token_ids(params.bad_words or [])
        request.seqs.append(Sequence(request, 0))
        request.seqs[0].grammar = grammar
        self.requests[request_id] = request
        self.scheduler.add(request.seqs[0])

    def _lora_adapter(self, lora_request: LoRARequest | None):
        if lora_request is None:
            return None
        if self.lora is None:
            raise InvalidRequest(f"LoRA adapter {lora_request.lora_name!r} asked for but LoRA is disabled; "
                                 "start the engine with enable_lora=True (--enable-lora)")
        return self.lora.load(lora_request)

    @property
    def vocab_size(self) -> int:
        return self.model.config.get_text_config().vocab_size

    def _structured(self):
        """The structured-output manager, built on first use (the grammar backend is imported only then)."""
        if self.sampler.structured is None:
            try:
                from paged_backend.structured.manager import StructuredOutputManager
            except ImportError as error:
                raise InvalidRequest(
                    f"structured outputs need the grammar engine, which is not installed ({error}); "
                    "install paged-backend[structured]"
                ) from error

            self.sampler.structured = StructuredOutputManager(
                self.tokenizer, vocab_size=self.vocab_size, eos_token_ids=self.eos_token_ids
            )
        return self.sampler.structured

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as token ids, alone and after a space (its mid-sentence form), as vLLM bans them."""
        banned: list[list[int]] = []
        for word in words:
            for form in (word, " " + word.lstrip()):
                ids = self.tokenizer(form, add_special_tokens=False).input_ids
                if ids and ids not in banned:
                    banned.append(ids)
        return banned

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its blocks now. Unknown or finished ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.is_finished:
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
                self.scheduler.remove(seq)
        request.finished = True
        request.metrics.finished_time = time.monotonic()
        if self.speculator is not None:
            self._retain_drafts()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return the outputs of every request that got a token (or finished)."""
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return []
        if self.speculator is not None:  # drafts ride along in the same forward, their slots appended now
            plan.copies += self.speculator.propose(plan.scheduled, self.config.scheduler.max_num_batched_tokens
                                                   - plan.num_tokens)  # fmt: skip
        self.kv_cache.swap_out(plan.swap_out)
        self.kv_cache.copy_blocks(plan.copies)
        self.kv_cache.swap_in(plan.swap_in)
        now = time.monotonic()
        for item in plan.scheduled:
            metrics = item.seq.request.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
        prompt_rows, prompt_segments = prompt_logprob_rows(plan.scheduled)
        forward_start = time.perf_counter()
        logits = self.runner.execute(plan.scheduled, prompt_rows)
        self._counters["forward_time"] += time.perf_counter() - forward_start
        if prompt_rows:
            record_prompt_logprobs(logits[len(logits) - len(prompt_rows) :], prompt_segments)

        sampling: list[Sequence] = []
        first_rows: list[int] = []  # each sampling sequence's first logits row (drafts add rows)
        drafts: dict[int, list[int]] = {}
        row = 0
        for item in plan.scheduled:
            seq = item.seq
            seq.num_computed_tokens = item.start + item.num_tokens - len(item.draft)  # drafts are not verified yet
            self.block_manager.commit(seq.seq_id, seq.num_computed_tokens)
            if item.samples:
                first_rows.append(row)
                row += 1 + len(item.draft)
                sampling.append(seq)
                if item.draft:
                    drafts[seq.seq_id] = item.draft
        advanced: dict[str, Request] = {}
        rows, seqs = self._fork_new_samples(sampling, advanced)
        rows = [first_rows[row] for row in rows]
        if drafts:
            rows, seqs = self._verify_drafts(logits, rows, seqs, drafts, advanced)
        tokens, logprobs = [], []
        if seqs:
            tokens, logprobs = self.sampler(logits[torch.tensor(rows, device=logits.device)], seqs)

        now = time.monotonic()
        for seq, token, logprob in zip(seqs, tokens, logprobs, strict=True):
            self._append_token(seq, token, logprob)
            advanced[seq.request.request_id] = seq.request
        self._counters["generation_tokens"] += len(tokens)
        self.scheduler.drop_finished()
        outputs = []
        for request in advanced.values():
            request.metrics.record_token(now)
            if all(seq.is_finished for seq in request.seqs):
                request.finished = True
                request.metrics.finished_time = now
                del self.requests[request.request_id]
            outputs.append(request.output())
        if self.speculator is not None:
            self._retain_drafts()
        self._peak_kv_usage = max(self._peak_kv_usage, self._kv_usage())
        self.kv_history.record(self.block_manager)
        self._counters["num_steps"] += 1
        self._counters["step_time"] += time.perf_counter() - started
        return outputs

    def _retain_drafts(self) -> None:
        self.speculator.retain({seq.seq_id for request in self.requests.values() for seq in request.seqs})

    def _verify_drafts(
        self, logits, rows: list[int], seqs: list[Sequence], drafts: dict[int, list[int]], advanced: dict
    ) -> tuple[list[int], list[Sequence]]:
        """Emit the verified tokens of speculating sequences and roll their rejected slots back; returns the rows and
        sequences left for the plain sampler."""
        plain_rows, plain = [], []
        for row, seq in zip(rows, seqs, strict=True):
            draft = drafts.get(seq.seq_id)
            if draft is None:
                plain_rows.append(row)
                plain.append(seq)
                continue
            tokens, logprobs = self.speculator.verify(logits[row : row + len(draft) + 1], seq, draft, self.sampler)
            for token, logprob in zip(tokens, logprobs, strict=True):
                self._append_token(seq, token, logprob)
                self._counters["generation_tokens"] += 1
                if seq.is_finished:  # a stop or max_tokens mid-proposal: its blocks are already freed
                    break
            advanced[seq.request.request_id] = seq.request
            if not seq.is_finished:
                # The accepted drafts' KV is valid; the last token is pending, as after a plain decode.
                seq.num_computed_tokens = seq.num_tokens - 1
                self.block_manager.truncate(seq.seq_id, seq.num_computed_tokens)
                self.block_manager.commit(seq.seq_id, seq.num_computed_tokens)
        return plain_rows, plain

    def _fork_new_samples(
        self, sampling: list[Sequence], advanced: dict[str, Request]
    ) -> tuple[list[int], list[Sequence]]:
        """Logits rows and sequences that sample this step. Requests whose prompt just finished prefilling fork their
        siblings (n, or best_of, sharing the prompt's blocks); prompt-only requests (max_tokens 0) finish instead."""
        rows: list[int] = []
        seqs: list[Sequence] = []
        for row, seq in enumerate(sampling):
            request = seq.request
            if request.forked:
                rows.append(row)
                seqs.append(seq)
                continue
            request.forked = True
            self._counters["prompt_tokens"] += len(request.prompt_token_ids)
            if request.params.max_tokens == 0:
                self._finish(seq, "length", None)
                advanced[request.request_id] = request
                continue
            rows.append(row)
            seqs.append(seq)
            for index in range(1, request.params.num_sequences):
                child = seq.fork(index)
                if seq.grammar is not None:  # siblings start their own walk through the grammar
                    child.grammar = self._structured().new_matcher(request.params.structured_outputs)
                self.block_manager.fork(seq.seq_id, child.seq_id)
                request.seqs.append(child)
                self.scheduler.add_running(child)
                rows.append(row)
                seqs.append(child)
        return rows, seqs

    def _append_token(self, seq: Sequence, token: int, logprob: dict[int, float] | None) -> None:
        seq.token_ids.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        if seq.grammar is not None:
            seq.grammar.accept(token)
        params = seq.request.params
        new_text = self._detokenize(seq)
        if seq.num_output_tokens >= params.min_tokens:
            if token in self.eos_token_ids and not params.ignore_eos:
                return self._finish(seq, "stop", None)
            if token in params.stop_token_ids:
                return self._finish(seq, "stop", token)
            for stop in params.stop:
                # Only the new text and the stop-string-long tail before it can hold a new match.
                at = seq.text.find(stop, max(0, len(seq.text) - len(new_text) - len(stop) + 1))
                if at != -1:
                    seq.text = seq.text[: at + len(stop) if params.include_stop_str_in_output else at]
                    return self._finish(seq, "stop", stop)
        if seq.grammar is not None and seq.grammar.is_terminated():
            return self._finish(seq, "stop", None)
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, "length", None)

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None) -> None:
        seq.status, seq.finish_reason, seq.stop_reason = SequenceStatus.FINISHED, reason, stop_reason
        self.scheduler.remove(seq)

    def _detokenize(self, seq: Sequence) -> str:
        """Append the text of the newest token(s); waits while bytes of a character are still incomplete."""
        params = seq.request.params
        options = {"skip_special_tokens": params.skip_special_tokens}
        if not params.spaces_between_special_tokens:  # only slow tokenizers read it; the default is True
            options["spaces_between_special_tokens"] = False
        ids = seq.token_ids
        before = self.tokenizer.decode(ids[seq.prefix_offset : seq.read_offset], **options)
        after = self.tokenizer.decode(ids[seq.prefix_offset :], **options)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        new_text = after[len(before) :]
        seq.text += new_text
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
        return new_text

    # ----------------------------------------------------------------- stats
    def _kv_usage(self) -> float:
        manager = self.block_manager
        return 1 - manager.num_free_blocks / (manager.num_blocks - 1)

    def kv_snapshot(self) -> dict:
        """The pool block by block (owner request, sharing, fill), plus recent history: what the KV map draws."""
        owners = {seq.seq_id: request.request_id for request in self.requests.values() for seq in request.seqs}
        return pool_snapshot(self.block_manager, owners, self.kv_history)

    def stats(self) -> EngineStats:
        scheduler, manager, counters = self.scheduler, self.block_manager, self._counters
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_swapped=len(scheduler.swapped),
            kv_usage=self._kv_usage(),
            peak_kv_usage=self._peak_kv_usage,
            num_preemptions=scheduler.num_preemptions,
            num_split_prefills=scheduler.num_split_prefills,
            prefix_cache_queries=manager.prefix_queries,
            prefix_cache_hits=manager.prefix_hits,
            prompt_tokens=counters["prompt_tokens"],
            generation_tokens=counters["generation_tokens"],
            num_steps=counters["num_steps"],
            step_time=counters["step_time"],
            forward_time=counters["forward_time"],
            **({} if self.lora is None else self.lora.adapters_in(scheduler)),
            **self._spec_decode_stats(),
        )

    def _spec_decode_stats(self) -> dict:
        spec = self.speculator
        if spec is None:
            return {}
        return dict(
            spec_decode_num_drafts=spec.num_drafts,
            spec_decode_num_draft_tokens=spec.num_draft_tokens,
            spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=tuple(spec.num_accepted_tokens_per_pos),
        )


class LLM:
    """Offline batch generation on top of `Engine`.

    >>> llm = LLM(device="cpu", num_blocks=64)
    >>> [out] = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3))
    >>> len(out.outputs[0].token_ids)
    3
    """

    def __init__(
        self,
        model: str | PreTrainedModel | None = None,
        *,
        tokenizer: str | PreTrainedTokenizerBase | None = None,
        **engine_kwargs,
    ) -> None:
        objects = not (model is None or isinstance(model, str))
        config = engine_config(model=None if objects else model,
                               tokenizer=None if objects or tokenizer is None else tokenizer, **engine_kwargs)
        self.engine = Engine(config, model=model if objects else None, tokenizer=tokenizer if objects else None)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        priority: list[int] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in input order.

        `priority` (one per prompt, smaller first) matters with the "priority" scheduling policy.
        `lora_request`: one adapter for all prompts, or one (or None for the base model) per prompt.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequest(f"{len(params)} sampling params for {len(prompts)} prompts; give one or one each")
        priority = priority or [0] * len(prompts)
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise InvalidRequest(f"{len(loras)} lora requests for {len(prompts)} prompts; give one or one each")
        ids: list[str] = []
        try:
            for prompt, param, rank, lora in zip(prompts, params, priority, loras, strict=True):
                request_id = str(next(self._ids))
                text, token_ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
                self.engine.add_request(request_id, text, param, prompt_token_ids=token_ids, priority=rank,
                                        lora_request=lora)
                ids.append(request_id)
        except Exception:
            for request_id in ids:  # all or nothing: a bad prompt leaves no half-queued batch behind
                self.engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt block (vLLM's call), e.g. after the model's weights changed: cached blocks hold
        KV computed with the old ones. Running sequences keep their blocks."""
        self.engine.block_manager.reset_prefix_cache()
        return True

    def kv_map(self, path: str = "kv_map.png", *, title: str = "KV pool"):
        """Draw the pool now as `path` (PNG) and the same name with .html; see `paged_backend.core.kv_map`."""
        from paged_backend.core.kv_map import draw_kv_map

        return draw_kv_map(self.engine.kv_snapshot(), path, title=title)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        progress = _progress(len(ids)) if use_tqdm else None
        generated, started = 0, time.perf_counter()
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    generated += 1
                    if output.finished:
                        finished[output.request_id] = output
                        if progress is not None:
                            progress.update(1)
                if progress is not None:
                    progress.set_postfix_str(f"{generated / (time.perf_counter() - started):.1f} tok/s")
        except BaseException:
            # A failed step (or Ctrl-C) fails this batch: abort what is left so its blocks are free and the
            # next generate() starts clean instead of resuming half-stepped requests.
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        finally:
            if progress is not None:
                progress.close()
        return [finished[request_id] for request_id in ids]


def kv_pool_blocks(
    cache: CacheConfig, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> tuple[int, int]:
    """(device blocks, CPU swap blocks) of a pool of this shape under the cache config's budget."""
    num_blocks = Engine._num_blocks(cache, (num_layers, kv_heads, head_dim, cache.block_size, dtype), device)
    return num_blocks, int(cache.swap_space * (1 << 30)) // bytes_per_block(
        num_layers, kv_heads, head_dim, cache.block_size, dtype
    )


def _progress(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="requests", unit="req", dynamic_ncols=True)


def engine_config(**kwargs) -> EngineConfig:
    """Build an `EngineConfig` from flat keyword arguments (vLLM style: `block_size=16, max_num_seqs=64`).

    >>> engine_config(block_size=8, max_num_seqs=4).scheduler.max_num_seqs
    4
    """
    groups = {"cache": CacheConfig, "scheduler": SchedulerConfig, "parallel": ParallelConfig}
    nested = {name: cls(**{k: kwargs.pop(k) for k in list(kwargs) if k in cls.model_fields})
              for name, cls in groups.items()}
    unknown = set(kwargs) - set(EngineConfig.model_fields)
    if unknown:
        raise InvalidRequest(f"unknown engine option(s): {', '.join(sorted(unknown))}")
    return EngineConfig(**nested, **kwargs)


def _largest(fits, high: int) -> int:
    """The largest n in 1..high with fits(n), for a monotone `fits` (0 if none)."""
    low = 0
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low
