"""Shard-side batch state (TGI's `Batch` protocol): from_pb, filter, concatenate, to_pb.

Each request wraps an engine `Sequence` (token ids, sampling params, seeded generator) so the engine's
`ModelRunner` and `Sampler` run on it unchanged; its KV lives where the router said (`blocks`, `slots`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from paged_backend.core.block_manager import slot_of
from paged_backend.engine.request import Request, Sequence
from paged_backend.errors import InvalidRequest
from paged_backend.tgi.backends.sampling import sampling_params
from paged_backend.tgi.backends.tokens import StoppingCriteria, TokenTexts
from paged_backend.tgi.http.grammar import ValidGrammar
from paged_backend.tgi.http.validation import ChooserParameters, StoppingParameters


@dataclass
class ShardRequest:
    id: int
    seq: Sequence
    blocks: list[int]
    slots: list[int]
    stopping: StoppingCriteria
    detokenizer: TokenTexts
    chooser: ChooserParameters
    prefill_logprobs: bool
    top_n_tokens: int
    num_computed_tokens: int  # tokens whose KV is already in the pool (cache_len at prefill)

    @property
    def generated_ids(self) -> list[int]:
        return self.seq.output_token_ids


@dataclass
class ShardBatch:
    id: int
    requests: list[ShardRequest] = field(default_factory=list)
    block_size: int = 16

    def __len__(self) -> int:
        return len(self.requests)

    def filter(self, request_ids: list[int]) -> ShardBatch:
        keep = set(request_ids)
        if not keep:  # TGI's server refuses it too; the router drops a finished batch with ClearCache
            raise InvalidRequest("FilterBatch needs request_ids; ClearCache drops a whole batch")
        unknown = sorted(keep - {request.id for request in self.requests})
        if unknown:
            raise InvalidRequest(f"batch {self.id} holds no request {', '.join(map(str, unknown))}")
        return ShardBatch(self.id, [r for r in self.requests if r.id in keep], self.block_size)

    @classmethod
    def concatenate(cls, batches: list[ShardBatch]) -> ShardBatch:
        """One batch (with the first one's id) holding every request of `batches`."""
        requests = [request for batch in batches for request in batch.requests]
        return cls(batches[0].id, requests, batches[0].block_size)

    def to_pb(self, pb):
        return pb.CachedBatch(
            id=self.id,
            request_ids=[r.id for r in self.requests],
            size=len(self.requests),
            max_tokens=sum(len(r.blocks) for r in self.requests) * self.block_size,
            current_tokens=len(self.requests),
        )


GRAMMAR_TYPES = {1: "json", 2: "regex"}  # GrammarType JSON / REGEX; NONE (0) means no grammar


def grammar_from_pb(parameters) -> ValidGrammar | None:
    """The router's grammar text and type (the router validated it; a bad one fails at the shard's compile)."""
    if parameters.grammar_type == 0 or not parameters.grammar:
        return None
    if parameters.grammar_type not in GRAMMAR_TYPES:
        raise InvalidRequest(f"grammar_type {parameters.grammar_type} is unknown; send GRAMMAR_TYPE_JSON or _REGEX")
    return ValidGrammar(GRAMMAR_TYPES[parameters.grammar_type], parameters.grammar)


def chooser_from_pb(parameters) -> ChooserParameters:
    """Router parameters with TGI's effective-sampling rule; unset proto floats mean 'off'."""
    chooser = ChooserParameters(
        temperature=parameters.temperature if parameters.temperature > 0 else 1.0,
        top_k=parameters.top_k,
        top_p=parameters.top_p if 0 < parameters.top_p < 1 else 1.0,
        typical_p=parameters.typical_p if 0 < parameters.typical_p < 1 else 1.0,
        repetition_penalty=parameters.repetition_penalty or 1.0,
        frequency_penalty=parameters.frequency_penalty,
        seed=parameters.seed,
        watermark=parameters.watermark,
        grammar=grammar_from_pb(parameters),
    )
    return replace(chooser, do_sample=parameters.do_sample or chooser.warpers_active)


def input_text(request) -> str:
    """Text chunks of the request (image chunks are for multimodal models; this shard serves text models)."""
    chunks = [chunk.text for chunk in request.input_chunks.chunks if chunk.WhichOneof("chunk") == "text"]
    return "".join(chunks) if request.input_chunks.chunks else request.inputs


def check_slots(blocks: list[int], slots: list[int], block_size: int, num_blocks: int | None) -> None:
    """The runner derives decode slots from the block table, so the router's slots must agree with it; and the
    kernels index the pool with these blocks unchecked, so a block past the pool is refused here (it wrote out of
    bounds before). `num_blocks` is None at Warmup, whose blocks the shard lays out itself."""
    if num_blocks is not None:
        outside = next((block for block in blocks if not 0 <= block < num_blocks), None)
        if outside is not None:
            raise InvalidRequest(f"block {outside} is outside the KV pool: blocks are 0..{num_blocks - 1}")
    if len(slots) > len(blocks) * block_size:
        raise InvalidRequest(f"{len(slots)} slots need {math.ceil(len(slots) / block_size)} blocks of {block_size} "
                             f"tokens; the request has {len(blocks)}")  # fmt: skip
    for position, slot in enumerate(slots):
        if slot != slot_of(blocks, position, block_size):
            raise InvalidRequest(
                f"slot {slot} at position {position} is not block {blocks[position // block_size]} offset "
                f"{position % block_size}; slots must follow the block table"
            )


def request_from_pb(
    request, tokenizer, eos_ids: set[int], block_size: int, num_blocks: int | None
) -> ShardRequest:
    if request.HasField("chunk_len"):
        raise InvalidRequest("chunked prefill (chunk_len) is not supported: this shard reports support_chunking=false")
    input_ids = tokenizer(input_text(request), add_special_tokens=request.add_special_tokens).input_ids
    if request.truncate:
        input_ids = input_ids[-request.truncate :]
    if not input_ids:
        raise InvalidRequest(f"request {request.id} has no input tokens")
    top_n_tokens = min(request.top_n_tokens, len(tokenizer))  # as TGI's server: never more than the vocabulary
    chooser = chooser_from_pb(request.parameters)
    stop = request.stopping_parameters
    stopping = StoppingParameters(
        max_new_tokens=stop.max_new_tokens,
        stop_sequences=tuple(stop.stop_sequences),
        ignore_eos_token=stop.ignore_eos_token,
    )
    # Prompt logprobs are the shard's own (from the router's cache_len on), not the engine's prompt_logprobs.
    params = sampling_params(chooser, stopping, top_n_tokens)
    seq = Sequence(Request(str(request.id), None, list(input_ids), params), 0)
    blocks, slots = list(request.blocks), list(request.slots)
    check_slots(blocks, slots, block_size, num_blocks)
    return ShardRequest(
        id=request.id,
        seq=seq,
        blocks=blocks,
        slots=slots,
        stopping=StoppingCriteria(eos_ids, stopping.stop_sequences, stop.max_new_tokens, stop.ignore_eos_token),
        detokenizer=TokenTexts(tokenizer, input_ids),
        chooser=chooser,
        prefill_logprobs=request.prefill_logprobs,
        top_n_tokens=top_n_tokens,
        # A fully cached prompt still recomputes its last token: its logits give the first new token.
        num_computed_tokens=min(request.cache_len, len(input_ids) - 1),
    )
