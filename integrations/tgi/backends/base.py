"""What the HTTP face needs from a backend: a token stream per validated request, and its health.

Backends emit token ids and logprobs only; the face turns them into text the same way for every backend,
so `--backend paged|reference|grpc` cannot differ in detokenization.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal, Protocol

from paged_backend.tgi.http.metrics import TgiMetrics
from paged_backend.tgi.http.validation import ValidRequest

FinishReason = Literal["length", "eos_token", "stop_sequence"]


@dataclass
class PrefillTokens:
    """Prompt tokens with the logprob of each given its prefix (the first has none)."""

    ids: list[int]
    logprobs: list[float | None]


@dataclass
class GeneratedToken:
    id: int
    logprob: float
    top_tokens: list[tuple[int, float]] = field(default_factory=list)
    # Set on the request's last token only.
    finish_reason: FinishReason | None = None


BackendEvent = PrefillTokens | GeneratedToken


@dataclass
class BackendLoad:
    queue_size: int = 0
    batch_size: int = 0
    kv_tokens_used: int = 0  # token slots held in KV blocks right now (0 once everything finished)
    kv_tokens_total: int = 0


class Backend(Protocol):
    name: str
    tokenizer: object
    max_model_len: int
    # Whether `decoder_input_details` (prompt logprobs) can be served.
    supports_prefill_logprobs: bool
    # Whether `grammar` (and the tools / response_format built on it) can be enforced.
    supports_grammar: bool

    async def start(self, metrics: TgiMetrics) -> None:
        """Begin serving; backends that batch for themselves (grpc) record the `tgi_batch_*` metrics."""

    async def shutdown(self, drain_timeout: float) -> None: ...

    def generate(self, request: ValidRequest) -> AsyncIterator[BackendEvent]:
        """Stream events of one request; closing the iterator early aborts it and frees its KV."""

    async def health(self) -> bool: ...

    def load(self) -> BackendLoad: ...
