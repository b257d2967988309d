"""The engine's side of speculative decoding: which decodes speculate, their drafts' slots, verification, counters."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_backend.config.speculative import SpeculativeConfig
from paged_backend.core.block_manager import BlockManager
from paged_backend.engine.request import Sequence
from paged_backend.engine.sampler import Sampler, logprob_entries, processes_logits
from paged_backend.engine.scheduler import ScheduledSequence
from paged_backend.errors import InvalidRequest
from paged_backend.spec_decode.draft_model import DraftModelProposer
from paged_backend.spec_decode.ngram import propose_ngram
from paged_backend.spec_decode.rejection import verify_greedy, verify_sampled
from paged_backend.worker.models import load_model

MAX_BACKOFF = 64


@dataclass
class Pace:
    """How far one sequence speculates, from how its own drafts fared (never from this step's draws, so rejection
    sampling stays exact). A draft fully accepted lengthens the next by one (up to k); one cut after `a` tokens
    makes the next `a + 1` long; one rejected outright makes the next a single-token probe and sits out 1, 3, 7,
    ... 63 decode steps first. So an unpredictable sequence costs a cheap probe now and then, not k wasted drafts."""

    k: int  # length of its next draft
    misses: int = 0  # drafts in a row rejected outright
    wait: int = 0  # decode steps still to sit out

    def update(self, drafted: int, accepted: int, longest: int) -> None:
        if accepted == drafted:
            self.k, self.misses = min(longest, self.k + 1), 0
        elif accepted:
            self.k, self.misses = accepted + 1, 0
        else:
            self.k, self.misses = 1, self.misses + 1
            self.wait = min(2**self.misses, MAX_BACKOFF) - 1


def speculates(seq: Sequence) -> bool:
    """Per request: only sampling whose next-token distribution does not depend on earlier draws in the same step
    speculates. Penalties, bad words, watermarks, min_tokens and prompt logprobs fall back to plain decoding;
    grammars speculate (their matcher walks the draft to mask each row, then rolls back)."""
    params = seq.request.params
    return not processes_logits(params) and params.prompt_logprobs is None and seq.num_output_tokens >= params.min_tokens


class Speculator:
    def __init__(self, config: SpeculativeConfig, block_manager: BlockManager, max_model_len: int, draft=None) -> None:
        self.config, self.block_manager, self.max_model_len = config, block_manager, max_model_len
        self.draft = draft  # a DraftModelProposer, or None for n-gram lookup
        k = config.num_speculative_tokens
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * k
        self.paces: dict[int, Pace] = {}  # of sequences that have drafted

    def propose(self, scheduled: list[ScheduledSequence], token_budget: int) -> list[tuple[int, int]]:
        """Give this step's eligible decodes their drafts (`item.draft`, slots appended, `num_tokens` grown) within
        `token_budget` extra tokens; returns copy-on-write pairs the cache must do first."""
        wanted: list[tuple[ScheduledSequence, int]] = []
        limit = self.config.disable_by_batch_size
        if limit is not None and len(scheduled) >= limit:  # big batches are compute-bound: rejected rows cost
            return []
        for item in scheduled:
            seq = item.seq
            if item.num_tokens != 1 or not item.samples or not speculates(seq):
                continue
            pace = self.paces.get(seq.seq_id)
            if pace is None:
                pace = self.paces[seq.seq_id] = Pace(self.config.num_speculative_tokens)
            if pace.wait:
                pace.wait -= 1
                continue
            params = seq.request.params
            # The step emits drafts plus one: never past max_tokens or max_model_len.
            room = min(params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
            k = min(pace.k, room, token_budget)
            if k > 0:
                wanted.append((item, k))
                token_budget -= k
        if self.draft is not None:
            found = self.draft.propose([(item.seq.seq_id, item.seq.token_ids, k) for item, k in wanted])
        else:
            config = self.config
            found = {item.seq.seq_id: propose_ngram(item.seq.token_ids, k, config.prompt_lookup_min,
                                                    config.prompt_lookup_max) for item, k in wanted}  # fmt: skip
        copies: list[tuple[int, int]] = []
        for item, _ in wanted:
            draft = found.get(item.seq.seq_id) or []
            if draft and self.block_manager.can_append(item.seq.seq_id, len(draft)):
                copies += self.block_manager.append_slots(item.seq.seq_id, draft)
                item.draft = draft
                item.num_tokens += len(draft)
        return copies

    def verify(
        self, logits: torch.Tensor, seq: Sequence, draft: list[int], sampler: Sampler
    ) -> tuple[list[int], list[dict[int, float] | None]]:
        """Tokens this step emits for `seq` from its `len(draft) + 1` logits rows (accepted drafts plus one), and
        their logprobs as the plain sampler reports them (cumulative logprob updated)."""
        params = seq.request.params
        if seq.grammar is not None:
            logits, draft = grammar_rows(logits, seq.grammar, draft, sampler.structured)
        if params.greedy:
            tokens = verify_greedy(logits, draft)
        else:
            probs = sampler._probabilities(logits, [params] * len(logits))
            tokens = verify_sampled(probs, draft, sampler.generator_for(seq))
        accepted = len(tokens) - 1
        self.paces[seq.seq_id].update(len(draft), accepted, self.config.num_speculative_tokens)
        self.num_drafts += 1
        self.num_draft_tokens += len(draft)
        self.num_accepted_tokens += accepted
        for position in range(accepted):
            self.num_accepted_tokens_per_pos[position] += 1
        logprobs: list[dict[int, float] | None] = [None] * len(tokens)
        if params.logprobs is not None or params.needs_cumulative_logprob:
            raw = torch.log_softmax(logits[: len(tokens)], dim=-1)
            if params.needs_cumulative_logprob:
                for i, token in enumerate(tokens):  # one at a time, as the plain sampler adds them
                    seq.cumulative_logprob += float(raw[i, token])
            logprobs = logprob_entries(raw, tokens, [params.logprobs] * len(tokens))
        return tokens, logprobs

    def retain(self, seq_ids: set[int]) -> None:
        """Forget draft state of sequences not in `seq_ids` (finished, aborted)."""
        self.paces = {seq_id: pace for seq_id, pace in self.paces.items() if seq_id in seq_ids}
        if self.draft is not None:
            self.draft.retain(seq_ids)


def grammar_rows(logits: torch.Tensor, matcher, draft: list[int], structured) -> tuple[torch.Tensor, list[int]]:
    """Rows masked by the grammar state each draft prefix leads to, and the draft cut before its first token the
    grammar forbids (or after the one that completes it). The matcher ends where it started."""
    masked = logits.clone()
    walked = 0
    for i in range(len(draft) + 1):
        structured.apply_masks(masked[i : i + 1], [matcher])
        if i == len(draft) or masked[i, draft[i]] == float("-inf"):
            break
        matcher.accept(draft[i])
        walked += 1
        if matcher.is_terminated():  # the sequence ends on this token: the row after it is never sampled from
            break
    matcher.rollback(walked)
    return masked[: walked + 1], draft[:walked]


def build_speculator(
    engine_config, manager: BlockManager, max_model_len: int, vocab_size: int, device, backend: str | None
) -> Speculator | None:
    """The engine's speculator from `speculative_config` (None when unset), proposing for the sequences of `manager`;
    refuses what it cannot run."""
    config = engine_config.speculative_config
    if config is None:
        return None
    if any(window is not None for window in manager.sliding_windows):
        # Windowed layers free blocks behind the window as decoding moves on; a rollback could need them again.
        raise InvalidRequest(
            "speculative_config does not run with sliding-window layers kept apart (a rollback could need blocks the "
            "window already freed); pass disable_hybrid_kv_cache_manager=True to keep one block table"
        )
    draft = None
    if config.method == "draft_model":
        model, loaded = config.model, isinstance(config.model, str)
        if loaded:
            model, _ = load_model(model, dtype=engine_config.dtype, device=str(device),
                                  trust_remote_code=engine_config.trust_remote_code)  # fmt: skip
        if model.config.get_text_config().vocab_size != vocab_size:
            raise InvalidRequest(
                f"the draft model's vocabulary ({model.config.get_text_config().vocab_size} tokens) differs from "
                f"the target's ({vocab_size}); use a draft with the target's tokenizer"
            )
        draft = DraftModelProposer(
            model, manager.num_blocks, manager.block_size, device, backend,
            pack=engine_config.prepack_weights, release=loaded,
        )  # fmt: skip
    return Speculator(config, manager, max_model_len, draft)
