"""The engine core (vLLM V1's EngineCore): add_request / step / abort_request over a scheduler, a model runner and,
when configured, a speculator whose drafts each step verifies.

Around it: `input_processor` checks and tokenizes requests, `output_processor` turns sampled tokens into outputs,
`stats` counts, and `assembly` builds the model, pool and runner it steps with. `LLM` (offline batches) is in `llm`.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from paged_backend.config import EngineConfig
from paged_backend.engine.assembly import assemble
from paged_backend.engine.beam_search import BeamSearch
from paged_backend.engine.detokenizer import eos_token_ids
from paged_backend.engine.generation_defaults import read_sampling_defaults
from paged_backend.engine.input_processor import InputProcessor
from paged_backend.engine.output_processor import OutputProcessor
from paged_backend.engine.prompt_logprobs import prompt_logprob_rows, record_prompt_logprobs
from paged_backend.engine.request import Request, RequestClass, RequestOutput, Sequence
from paged_backend.engine.sampler import Sampler
from paged_backend.engine.sampling_params import SamplingParams
from paged_backend.engine.scheduler import Scheduler
from paged_backend.engine.stats import EngineCounters, EngineStats
from paged_backend.errors import InvalidRequest
from paged_backend.lora import LoRARequest
from paged_backend.spec_decode.speculator import build_speculator
from paged_backend.worker.runner import StepCut


class Engine:
    """Continuous-batching engine: add requests, call `step()` until done, read cumulative outputs.

    >>> from paged_backend.config import CacheConfig
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
        parts = assemble(config, model, tokenizer)
        self.model, self.tokenizer, self.parallel = parts.model, parts.tokenizer, parts.parallel
        self.kv_cache, self.block_manager, self.runner = parts.kv_cache, parts.block_manager, parts.runner
        self.max_model_len, self.lora = parts.max_model_len, parts.lora
        mode = config.scheduler.preemption_mode or ("swap" if self.kv_cache.num_cpu_blocks else "recompute")
        self.scheduler = Scheduler(
            config.scheduler, self.block_manager, mode, parts.prefill_chunk_limit,
            admits_adapter=None if self.lora is None else self.lora.admits,
        )  # fmt: skip
        self.speculator = build_speculator(
            config, self.block_manager, self.max_model_len, self.vocab_size, self.kv_cache.device, parts.backend
        )
        self.eos_token_ids = eos_token_ids(self.tokenizer, getattr(self.model, "generation_config", None))
        self.sampler = Sampler(self.eos_token_ids, seed=config.seed, device=parts.device)
        self.sampling_defaults = read_sampling_defaults(config, self.model)  # for the fields a request leaves out
        self.requests: dict[str, Request] = {}
        self.input_processor = InputProcessor(
            config, self.tokenizer, vocab_size=self.vocab_size, max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids, sampler=self.sampler, lora=self.lora,
        )  # fmt: skip
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler)
        self.counters = EngineCounters(self.block_manager)
        self.beam_search = BeamSearch(self)
        # Cutting a step (cut_step_for): the step in flight and the best rank it computes, and the step to cut.
        self._steps_cut = self.runner.cuts_steps and self.speculator is None and self.parallel is None
        self._in_flight: tuple[int, tuple[bool, int]] | None = None
        self._cut_step = -1

    @property
    def vocab_size(self) -> int:
        return self.model.config.get_text_config().vocab_size

    def set_tokenizer(self, tokenizer) -> None:
        """Tokenize, detokenize and read EOS ids with `tokenizer` from the next request on (vLLM's
        `set_tokenizer`); its ids must be the model's, since nothing is re-embedded."""
        self.tokenizer = self.input_processor.tokenizer = self.output_processor.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids(tokenizer, getattr(self.model, "generation_config", None))
        self.input_processor.eos_token_ids = self.eos_token_ids
        self.sampler.eos_token_ids = sorted(self.eos_token_ids)
        self.sampler.structured = None  # its grammars index the old vocabulary; rebuilt on the next constrained request

    def close(self) -> None:
        """Stop the worker ranks of a parallel engine (a no-op for one process); idempotent."""
        if self.parallel is not None:
            self.parallel.close()

    # ------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str,
        prompt: str | dict | list[int] | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        request_class: RequestClass = "interactive",
    ) -> None:
        """Queue a request. Bad input raises `InvalidRequest` / `PromptTooLong` at once and queues nothing.

        `prompt` is text, token ids, or vLLM's {"prompt": text} / {"prompt_token_ids": ids}. `lora_request` runs the
        request with that adapter (loaded here, before anything is queued). `priority` (smaller first) orders the
        "priority" policy; `request_class="batch"` runs only on capacity interactive requests leave over."""
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use; give each request a unique id")
        if sampling_params is not None and sampling_params.use_beam_search and self.speculator is not None:
            raise InvalidRequest("beam search does not run with speculative decoding; send this request to an engine "
                                 "started without a speculative config, or drop use_beam_search")  # fmt: skip
        request = self.input_processor.process(
            request_id, prompt, sampling_params, prompt_token_ids=prompt_token_ids, priority=priority,
            lora_request=lora_request, request_class=request_class,
        )  # fmt: skip
        self.requests[request_id] = request
        self.scheduler.add(request.seqs[0])

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its blocks now. Unknown or finished ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.is_finished:
                self.output_processor.finish(seq, "abort")
        request.finished = True
        request.metrics.finished_time = time.monotonic()
        if self.speculator is not None:
            self._retain_drafts()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def cut_step_for(self, priority: int = 0, request_class: RequestClass = "interactive") -> bool:
        """Ask the step in flight to stop at its next layer boundary when a request of this rank (`Scheduler.rank`)
        outranks everything the step computes; True if asked. Safe from any thread: a server calls it right after
        queueing such a request, so a long CPU decode step does not hold up its first token.

        A cut step changes nothing but the KV slots it was filling, which the next step writes again: sequences
        keep their progress and blocks, and the newcomer's prefill then runs alone (the scheduler defers whatever
        it outranks). Single-process engines on the fused forward, without speculative decoding, cut steps."""
        in_flight = self._in_flight
        if in_flight is None or self.scheduler.rank(request_class, priority) >= in_flight[1]:
            return False
        self._cut_step = in_flight[0]
        return True

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return the outputs of every request that got a token (or finished)."""
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        if not plan.scheduled and self.scheduler.release_parked():  # beams waiting on a sibling that has no room
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
        rows = [item.rows(self.block_manager.block_tables(item.seq.seq_id)) for item in plan.scheduled]
        step = self.scheduler.num_steps
        if self._steps_cut:
            best = min(self.scheduler.rank_of(item.seq) for item in plan.scheduled)
            self._in_flight = step, best
        try:
            with self._adapters(plan.scheduled):
                logits = self.runner.execute(rows, prompt_rows, cut=lambda: self._cut_step == step)
        except StepCut:  # a request that outranks the whole step arrived: it goes next, this step's work after it
            self.counters.num_cut_steps += 1
            return []
        finally:
            self._in_flight = None
            self.counters.forward_time += time.perf_counter() - forward_start
        if prompt_rows:
            record_prompt_logprobs(logits[len(logits) - len(prompt_rows) :], prompt_segments,
                                   self.output_processor.token_texts)  # fmt: skip

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
        rows, seqs = self._propose_beams(logits, rows, seqs, advanced)
        tokens, logprobs = [], []
        if seqs:
            tokens, logprobs = self.sampler(_rows_of(logits, rows), seqs)

        now = time.monotonic()
        for seq, token, logprob in zip(seqs, tokens, logprobs, strict=True):
            self.output_processor.append_token(seq, token, logprob)
            advanced[seq.request.request_id] = seq.request
        self.counters.generation_tokens += len(tokens)
        self.scheduler.drop_finished()
        outputs = self.output_processor.request_outputs(advanced.values(), now)
        for output in outputs:
            if output.finished:
                del self.requests[output.request_id]
        if self.speculator is not None:
            self._retain_drafts()
        self.counters.end_step(started, plan.num_tokens)
        return outputs

    def _adapters(self, scheduled):
        """The step's LoRA adapters active for its forward: each packed row computes with its request's."""
        if self.lora is None:
            return nullcontext()
        return self.lora.activate([(item.seq.request.lora_adapter, item.num_tokens) for item in scheduled])

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
                self.output_processor.append_token(seq, token, logprob)
                self.counters.generation_tokens += 1
                if seq.is_finished:  # a stop or max_tokens mid-proposal: its blocks are already freed
                    break
            advanced[seq.request.request_id] = seq.request
            if not seq.is_finished:
                # The accepted drafts' KV is valid; the last token is pending, as after a plain decode.
                seq.num_computed_tokens = seq.num_tokens - 1
                self.block_manager.truncate(seq.seq_id, seq.num_computed_tokens)
                self.block_manager.commit(seq.seq_id, seq.num_computed_tokens)
        return plain_rows, plain

    def _propose_beams(
        self, logits, rows: list[int], seqs: list[Sequence], advanced: dict
    ) -> tuple[list[int], list[Sequence]]:
        """Beam-search sequences take their candidates (`beam_search`); returns the rows and sequences that sample."""
        beams: tuple[list[int], list[Sequence]] = ([], [])
        plain: tuple[list[int], list[Sequence]] = ([], [])
        for row, seq in zip(rows, seqs, strict=True):
            side = beams if seq.request.params.use_beam_search else plain
            side[0].append(row)
            side[1].append(seq)
        if beams[1]:
            self.beam_search.propose(_rows_of(logits, beams[0]), beams[1], advanced)
        return plain

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
            self.counters.prompt_tokens += len(request.prompt_token_ids)
            if request.params.max_tokens == 0:  # each of the n completions ends here, empty (vLLM returns n)
                self.output_processor.finish(seq, "length")
                for index in range(1, request.params.n):
                    request.seqs.append(child := seq.fork(index))
                    self.output_processor.finish(child, "length")
                advanced[request.request_id] = request
                continue
            rows.append(row)
            seqs.append(seq)
            siblings = 0 if request.params.use_beam_search else request.params.num_sequences - 1  # beams fork as they go
            for index in range(1, 1 + siblings):
                child = seq.fork(index)
                if seq.grammar is not None:  # siblings start their own walk through the grammar
                    child.grammar = self.input_processor.grammar_matcher(request.params)
                self.block_manager.fork(seq.seq_id, child.seq_id)
                request.seqs.append(child)
                self.scheduler.add_running(child)
                rows.append(row)
                seqs.append(child)
        return rows, seqs

    # ----------------------------------------------------------------- stats
    def kv_snapshot(self) -> dict:
        """The pool block by block (owner request, sharing, fill), plus recent history: what the KV map draws."""
        return self.counters.kv_snapshot(self.requests)

    def stats(self) -> EngineStats:
        return self.counters.stats(self.scheduler, self.lora, self.speculator)


def _rows_of(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """`logits[rows]`; when the rows are every row in order (a plain decode step, a step of beams alone), the logits
    themselves, with no copy (0.3 ms at 16 rows of a 49k vocabulary)."""
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):  # (forks repeat rows: compare them all)
        return logits
    return logits[torch.tensor(rows, device=logits.device)]
