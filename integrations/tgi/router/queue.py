"""Waiting requests and how the next batch is cut from them, allocating KV blocks as TGI's router does."""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from dataclasses import dataclass, field, fields

from paged_backend.core.block_manager import BlockManager
from paged_backend.tgi.http.validation import ChooserParameters, ValidRequest
from paged_backend.tgi.proto import generate_pb2 as pb


@dataclass(eq=False)
class Entry:
    """One request between the HTTP face and the shard; `events` carries its tokens or its error."""

    id: int
    request: ValidRequest
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    dropped: bool = False  # the client went away; the loop frees it at the next step

    @property
    def num_slots(self) -> int:
        """KV slots the request can fill: every prompt token and every generated token but the last."""
        return self.request.input_length + self.request.stopping.max_new_tokens - 1


GRAMMAR_TYPES = {None: pb.GRAMMAR_TYPE_NONE, "json": pb.GRAMMAR_TYPE_JSON, "regex": pb.GRAMMAR_TYPE_REGEX}


def chooser_pb(chooser: ChooserParameters) -> pb.NextTokenChooserParameters:
    """Every ChooserParameters field under its own name in the message; the grammar as its text and type."""
    same_named = {each.name: getattr(chooser, each.name) for each in fields(chooser) if each.name != "grammar"}
    grammar = chooser.grammar
    return pb.NextTokenChooserParameters(
        **same_named,
        grammar="" if grammar is None else grammar.text,
        grammar_type=GRAMMAR_TYPES[None if grammar is None else grammar.type],
    )


def request_pb(entry: Entry, blocks: list[int], slots: list[int]) -> pb.Request:
    request, stopping = entry.request, entry.request.stopping
    return pb.Request(
        id=entry.id,
        inputs=request.inputs,
        input_chunks=pb.Input(chunks=[pb.InputChunk(text=request.inputs)]),
        truncate=request.truncate or 0,
        parameters=chooser_pb(request.parameters),
        stopping_parameters=pb.StoppingCriteriaParameters(
            max_new_tokens=stopping.max_new_tokens,
            stop_sequences=list(stopping.stop_sequences),
            ignore_eos_token=stopping.ignore_eos_token,
        ),
        prefill_logprobs=request.decoder_input_details,
        top_n_tokens=request.top_n_tokens,
        blocks=blocks,
        slots=slots,
        add_special_tokens=request.add_special_tokens,
    )


class Queue:
    def __init__(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager
        self.entries: deque[Entry] = deque()
        self.has_entries = asyncio.Event()
        self._batch_ids = itertools.count()

    def __len__(self) -> int:
        return len(self.entries)

    def append(self, entry: Entry) -> None:
        self.entries.append(entry)
        self.has_entries.set()

    def next_batch(
        self, min_size: int | None, max_size: int | None, prefill_token_budget: int
    ) -> tuple[pb.Batch, dict[int, Entry]] | None:
        """Take requests in arrival order while the prefill budget, `max_size` and free blocks allow.

        Returns None (and allocates nothing) when fewer than `min_size` requests would go.
        """
        manager = self.block_manager
        taken: list[tuple[Entry, list[int], list[int]]] = []
        prefill_tokens = 0
        while self.entries and (max_size is None or len(taken) < max_size):
            entry = self.entries[0]
            if entry.dropped:
                self.entries.popleft()
                continue
            reserved = list(entry.request.input_ids) + [0] * (entry.num_slots - entry.request.input_length)
            if prefill_tokens + entry.request.input_length > prefill_token_budget and taken:
                break
            if not manager.can_allocate(reserved):
                break
            self.entries.popleft()
            manager.allocate(entry.id, reserved)
            taken.append((entry, manager.block_table(entry.id), manager.slot_mapping(entry.id, 0, entry.num_slots)))
            prefill_tokens += entry.request.input_length
        if not self.entries:
            self.has_entries.clear()
        if not taken or (min_size is not None and len(taken) < min_size):
            for entry, _, _ in reversed(taken):
                manager.free(entry.id)
                self.entries.appendleft(entry)
            if self.entries:
                self.has_entries.set()
            return None
        requests = [request_pb(entry, blocks, slots) for entry, blocks, slots in taken]
        batch = pb.Batch(
            id=next(self._batch_ids),
            requests=requests,
            size=len(requests),
            max_tokens=sum(entry.num_slots + 1 for entry, _, _ in taken),
            max_blocks=max(len(blocks) for _, blocks, _ in taken),
        )
        return batch, {entry.id: entry for entry, _, _ in taken}
