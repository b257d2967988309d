"""Iteration-level scheduling: which sequences run this step, how many tokens each, who gets preempted.

Running sequences go first, decodes before prefill chunks so a long prompt never starves them; decodes that the
step's token budget left out go first next step, so a budget smaller than the batch takes turns. Waiting
sequences are admitted only when their whole prompt fits above the watermark (windowed layer groups: its first
chunk, as they hold a bounded share) and nobody was preempted this step, which keeps admission from thrashing
against preemption.

Order is `key`: interactive before "batch" requests, then (the "priority" policy) smaller priority, then arrival.
A waiting head that outranks running sequences (a better class; under "priority", a better key) preempts them,
worst first, when that and only that lets it in; one that would not fit anyway preempts nobody. A step that
prefills a better-ranked request (a better class, or under "priority" a smaller priority) runs nothing it ranks
above: their decodes sit that one step out, so its first token costs its own prefill and not theirs too.
"""

from __future__ import annotations

from bisect import insort
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from paged_backend.config import SchedulerConfig
from paged_backend.core.block_manager import NULL_BLOCK, BlockManager
from paged_backend.engine.request import Sequence, SequenceStatus
from paged_backend.worker.runner import SequenceRows


@dataclass
class ScheduledSequence:
    seq: Sequence
    start: int  # first position computed this step
    num_tokens: int  # drafts included
    draft: list[int] = field(default_factory=list)  # speculative tokens fed after the sequence's own (spec_decode)

    @property
    def is_prefill(self) -> bool:
        """This chunk computes prompt (or recomputed) tokens, not just the latest sampled one."""
        return self.num_tokens - len(self.draft) > 1 or self.start < self.seq.num_prompt_tokens

    @property
    def samples(self) -> bool:
        """This chunk reaches the sequence's last token, so the step samples its next one."""
        return self.start + self.num_tokens - len(self.draft) == self.seq.num_tokens

    def rows(self, block_tables: list[list[int]]) -> SequenceRows:
        """What the runner needs of this sequence's share of the step, given its block tables (one per group)."""
        own = self.seq.token_ids[self.start : self.start + self.num_tokens - len(self.draft)]
        return SequenceRows(own + self.draft, self.start, block_tables, 1 + len(self.draft) if self.samples else 0)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block)

    @property
    def num_tokens(self) -> int:
        return sum(item.num_tokens for item in self.scheduled)


class Scheduler:
    """Decides each step's batch under the `max_num_seqs` / `max_num_batched_tokens` budgets."""

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        preemption_mode: str,
        max_chunk: int | None = None,
        admits_adapter: Callable | None = None,
    ) -> None:
        self.config = config
        self.max_chunk = max_chunk or config.max_num_batched_tokens  # one sequence's prefill chunk (windowed pools)
        self.block_manager = block_manager
        self.preemption_mode = preemption_mode
        self.waiting: list[Sequence] = []  # kept sorted by `key`
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []  # kept sorted by `key`
        self.set_aside: list[Sequence] = []  # beams that proposed, out of the pool until their request chooses
        self.num_preemptions = 0
        self.num_steps = 0
        self.num_split_prefills = 0  # prefill chunks that stopped before the end of their prompt
        self.admits_adapter = admits_adapter  # LoRAManager.admits with adapters on: caps adapters running at once

    def rank(self, request_class: str, priority: int) -> tuple[bool, int]:
        """A request's rank, smaller first: batch requests below every interactive one in both policies, then (under
        "priority") smaller priority. Arrival breaks ties in `key`, not here."""
        return request_class == "batch", priority if self.config.policy == "priority" else 0

    def key(self, seq: Sequence) -> tuple[bool, int, int, int]:
        """Smaller = served first, preempted last."""
        request = seq.request
        return *self.rank(request.request_class, request.priority), request.arrival_order, seq.index

    def outranks(self, seq: Sequence, other: Sequence) -> bool:
        """Whether `seq` may take `other`'s place: a better class, or under "priority" a strictly better key (fcfs
        never preempts its own class for a later request)."""
        if self.config.policy == "priority":
            return self.key(seq) < self.key(other)
        return self.key(seq)[0] < self.key(other)[0]

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        insort(self.waiting, seq, key=self.key)

    def add_running(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Forget a finished or aborted sequence and free its blocks at once."""
        for queue in (self.waiting, self.running, self.swapped, self.set_aside):
            if seq in queue:
                queue.remove(seq)
        if self.block_manager.has(seq.seq_id):
            self.block_manager.free(seq.seq_id)

    def drop_finished(self) -> None:
        self.running = [seq for seq in self.running if not seq.is_finished]

    def release_parked(self) -> bool:
        """Free the blocks of the running sequences with nothing to compute (beams that proposed and wait on a
        sibling) and set them aside, so the sibling gets room; True if there were any. Called when a step scheduled
        nothing, which would otherwise repeat forever. They are recomputed once their request has chosen (`wake`)."""
        parked = [seq for seq in self.running if seq.num_computed_tokens == seq.num_tokens]
        for seq in parked:
            self.running.remove(seq)
            self.num_preemptions += 1
            self._drop_kv(seq)
            seq.status = SequenceStatus.WAITING
            self.set_aside.append(seq)
        return bool(parked)

    def wake(self, seq: Sequence) -> None:
        """A set-aside sequence queues again (its request chose, so it has a token to compute)."""
        if seq in self.set_aside:
            self.set_aside.remove(seq)
            self.add(seq)

    # ------------------------------------------------------------------ step
    def schedule(self) -> SchedulerOutput:
        self.num_steps += 1
        out = SchedulerOutput()
        self._make_room_for_waiting(out)
        budget = self.config.max_num_batched_tokens
        ordered = sorted(self.running, key=self.key)
        self.running = []
        head = self.waiting[0] if self.waiting else None
        lead = self._lead_prefill(ordered, head)
        deferred = [seq for seq in ordered if lead is not None and self.ranks_above(lead, seq)]
        budget, preempted = self._schedule_running(ordered[: len(ordered) - len(deferred)], budget, head, out)
        self.running += deferred  # they keep their seats while the others are admitted
        if not preempted:
            budget = self._swap_in(budget, out)
            self._admit(budget, out)
        if deferred and not any(self.ranks_above(item.seq, deferred[0]) for item in out.scheduled if item.is_prefill):
            # The lead did not prefill after all, so they run on what is left of the step. (When it does, the step
            # runs nothing it ranks above: a better request's first token costs its own prefill only.)
            waiting_their_turn = {id(seq) for seq in deferred}
            self.running = [seq for seq in self.running if id(seq) not in waiting_their_turn]
            self._schedule_running(deferred, self.config.max_num_batched_tokens - out.num_tokens, None, out)
        return out

    def _schedule_running(
        self, ordered: list[Sequence], budget: int, head: Sequence | None, out: SchedulerOutput
    ) -> tuple[int, bool]:
        """Schedule running sequences (sorted by `key`), decodes before prefill chunks, preempting the worst of them
        when blocks run out; returns the budget left and whether anyone was preempted."""
        queue = deque(self._decodes_in_turn([seq for seq in ordered if seq.is_decoding], budget))
        queue.extend(seq for seq in ordered if not seq.is_decoding)
        preempted = False
        while queue:
            seq = queue.popleft()
            num_new = self._chunk(seq, budget - self._held_for(head, seq, budget))
            if num_new == 0:
                self.running.append(seq)  # stays running; no budget left this step
                continue
            while not self._can_reserve(seq, num_new):
                victim = max([*queue, seq], key=self.key)  # the lowest-priority one, possibly `seq` itself
                if victim is not seq:
                    queue.remove(victim)
                self._preempt(victim, out)
                preempted = True
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                budget -= self._reserve_and_schedule(seq, num_new, out)
        return budget, preempted

    def _decodes_in_turn(self, decodes: list[Sequence], budget: int) -> list[Sequence]:
        """`decodes` (in `key` order) as the step should visit them: when the budget cannot hold them all, those
        left out longest go first (within their rank), so a budget smaller than the batch takes turns instead of
        starving the same sequences. Each part stays in `key` order, so preemption still picks the worst first."""
        if len(decodes) <= budget:
            return decodes
        turns = sorted(decodes, key=lambda seq: (self.rank_of(seq), seq.last_scheduled_step))
        chosen = {id(seq) for seq in turns[:budget]}
        return [seq for seq in decodes if id(seq) in chosen] + [seq for seq in decodes if id(seq) not in chosen]

    def rank_of(self, seq: Sequence) -> tuple[bool, int]:
        return self.rank(seq.request.request_class, seq.request.priority)

    def ranks_above(self, seq: Sequence, other: Sequence) -> bool:
        """A better `rank` (arrival order does not count here)."""
        return self.rank_of(seq) < self.rank_of(other)

    def _lead_prefill(self, running: list[Sequence], head: Sequence | None) -> Sequence | None:
        """The best-ranked sequence that may prefill this step: the waiting head or a running prompt in chunks. The
        sequences it ranks above sit the step out if it does prefill, so its first token costs its own prefill only."""
        candidates = [seq for seq in running if seq.num_computed_tokens < seq.num_tokens - 1]
        candidates += [head] if head is not None else []
        return min(candidates, key=self.key, default=None)

    def _held_for(self, head: Sequence | None, seq: Sequence, budget: int) -> int:
        """Tokens of the step a prompt chunk of `seq` leaves to the waiting `head` when `head` outranks it, so an
        interactive (or, under "priority", a better) newcomer never waits on a worse prompt's prefill."""
        if head is None or seq.is_decoding or not self.outranks(head, seq):
            return 0
        return self._chunk(head, budget)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens `seq` computes this step: all it has left, or a budget-sized chunk of its prefill."""
        remaining = seq.num_tokens - seq.num_computed_tokens
        if remaining > budget and not self.config.enable_chunked_prefill:
            return 0
        return min(remaining, budget, self.max_chunk)

    def _pending(self, seq: Sequence) -> list[int]:
        """Tokens sampled since the block manager last saw the sequence (they need slots)."""
        return seq.token_ids[self.block_manager.num_tokens(seq.seq_id) :]

    def _can_reserve(self, seq: Sequence, num_new: int) -> bool:
        until = seq.num_computed_tokens + num_new
        return self.block_manager.can_append(seq.seq_id, len(self._pending(seq)), until)

    def _reserve_and_schedule(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> int:
        start = seq.num_computed_tokens
        out.copies += self.block_manager.append_slots(seq.seq_id, self._pending(seq), until=start + num_new)
        out.scheduled.append(ScheduledSequence(seq, start, num_new))
        seq.last_scheduled_step = self.num_steps
        if start + num_new < seq.num_tokens:
            self.num_split_prefills += 1
        self.running.append(seq)
        return num_new

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.num_preemptions += 1
        manager = self.block_manager
        if self.preemption_mode == "swap" and manager.can_swap_out([seq.seq_id]):
            out.swap_out += manager.swap_out([seq.seq_id])
            seq.status = SequenceStatus.SWAPPED
            insort(self.swapped, seq, key=self.key)
            return
        self._drop_kv(seq)
        self.add(seq)

    def _drop_kv(self, seq: Sequence) -> None:
        """Preemption by recompute: free the KV; the sequence re-prefills prompt + output later (prefix cache helps)."""
        self.block_manager.free(seq.seq_id)
        seq.num_computed_tokens = 0

    def _make_room_for_waiting(self, out: SchedulerOutput) -> None:
        """Preempt the running sequences the waiting head outranks, worst first, as many as it needs to fit."""
        if not self.waiting:
            return
        head = self.waiting[0]
        victims = sorted((seq for seq in self.running if self.outranks(head, seq)), key=self.key, reverse=True)
        if not victims:
            return
        for victim in victims[: self._victims_needed(head, victims)]:
            self.running.remove(victim)
            self._preempt(victim, out)

    def _victims_needed(self, head: Sequence, victims: list[Sequence]) -> int:
        """How many of `victims` (worst first) must go for `head` to have its blocks and seats while the others grow
        this step; 0 when it fits already, or would not fit even with every victim gone (that would only thrash)."""
        manager = self.block_manager
        width = 1 if head.request.forked else head.request.params.num_sequences
        seats = self.config.max_num_seqs - len(self.running)
        need, hit_ids = self._blocks_to_admit(head)
        growth = {seq.seq_id: manager.blocks_to_append(seq.seq_id, len(self._pending(seq))) for seq in self.running}
        free = manager.num_free_blocks - manager.watermark_blocks - sum(growth.values())
        holders: Counter[int] = Counter()  # block id -> how many of its holders are victims so far
        for count, victim in enumerate(victims):
            if need <= free and width <= seats:
                return count
            seats += 1
            free += growth[victim.seq_id]
            for block_id in {block for table in manager.block_tables(victim.seq_id) for block in table} - {NULL_BLOCK}:
                holders[block_id] += 1
                # Freed once its last holder goes; a freed hit of the head's costs it a block again, so it nets out.
                if holders[block_id] == manager.blocks[block_id].ref_count and block_id not in hit_ids:
                    free += 1
        return len(victims) if need <= free and width <= seats else 0

    def _blocks_to_admit(self, seq: Sequence) -> tuple[int, set[int]]:
        """Blocks admitting `seq` takes from the free pool, and the ids of its prefix-cache hits."""
        request = seq.request
        chunk = min(self.config.max_num_batched_tokens, self.max_chunk)
        return self.block_manager.blocks_to_allocate(
            seq.token_ids, request.prefix_cache_key, lookup=request.reads_prefix_cache, chunk=chunk
        )

    def _swap_in(self, budget: int, out: SchedulerOutput) -> int:
        manager = self.block_manager
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            if self.waiting and self.outranks(self.waiting[0], seq):
                break  # the room is the waiting head's (it may have just preempted `seq` for it)
            num_new = self._chunk(seq, budget)
            grow = manager.blocks_to_append(seq.seq_id, len(self._pending(seq)), seq.num_computed_tokens + num_new)
            # Its CPU copies are its own, so no copy-on-write follows: it needs its blocks plus the step's growth.
            if sum(manager.num_blocks_held(seq.seq_id)) + grow > manager.num_free_blocks - manager.watermark_blocks:
                break
            self.swapped.pop(0)
            out.swap_in += manager.swap_in([seq.seq_id])
            seq.status = SequenceStatus.RUNNING
            if num_new == 0:
                self.running.append(seq)
                break
            budget -= self._reserve_and_schedule(seq, num_new, out)
        return budget

    def _admit(self, budget: int, out: SchedulerOutput) -> None:
        manager = self.block_manager
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if self.swapped and self.outranks(self.swapped[0], seq):
                break  # a better sequence is still waiting to swap back in
            # A fresh request reserves room for all its n samples, which fork right after the prefill.
            width = 1 if seq.request.forked else seq.request.params.num_sequences
            if len(self.running) + width > self.config.max_num_seqs:
                break
            if not self.config.enable_chunked_prefill and seq.num_tokens > budget:
                break
            adapter = seq.request.lora_adapter
            if adapter is not None and not self.admits_adapter(
                adapter, [s.request.lora_adapter for s in self.running + self.swapped]
            ):
                break
            lookup, extra_keys = seq.request.reads_prefix_cache, seq.request.prefix_cache_key
            chunk = min(budget, self.max_chunk)  # windowed groups take only the first chunk's blocks now
            if not manager.can_allocate(seq.token_ids, extra_keys, lookup=lookup, chunk=chunk):
                break
            self.waiting.pop(0)
            seq.num_computed_tokens = manager.allocate(
                seq.seq_id, seq.token_ids, extra_keys, lookup=lookup, chunk=chunk
            )
            if seq.request.num_cached_tokens is None:  # the first admission's prefix hit is what the client saved
                seq.request.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
            seq.status = SequenceStatus.RUNNING
            budget -= self._reserve_and_schedule(seq, self._chunk(seq, budget), out)
