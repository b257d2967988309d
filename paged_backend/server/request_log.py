"""vLLM's `--enable-log-requests`: one INFO line per request the engine receives ("Received request ..."), its prompt
cut to `--max-log-len`. It wraps `AsyncEngine.generate`, which every route's requests pass through."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from paged_backend.engine.async_engine import AsyncEngine, EngineThread
from paged_backend.engine.engine import Engine

logger = logging.getLogger(__name__)


class RequestLoggingEngine(AsyncEngine):
    """vLLM's `--enable-log-requests`: one INFO line per request the engine receives, with its id, prompt (its first
    `max_log_len` characters and token ids), sampling params and adapter: every route's requests pass here."""

    def __init__(self, engine: Engine, engine_thread: EngineThread | None, max_log_len: int | None) -> None:
        super().__init__(engine, engine_thread)
        self.max_log_len = max_log_len

    def generate(self, request_id: str, prompt=None, sampling_params=None, **kwargs) -> AsyncIterator:
        if logger.isEnabledFor(logging.INFO):  # the routes pass text, or token ids as prompt_token_ids
            token_ids, cut = kwargs.get("prompt_token_ids"), self.max_log_len
            shown = prompt if token_ids is None else self.engine.tokenizer.decode(token_ids[:cut])  # chat: the template
            logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s, lora_request: %s.",
                        request_id, shown if shown is None else shown[:cut], sampling_params,
                        token_ids if token_ids is None else token_ids[:cut], kwargs.get("lora_request"))  # fmt: skip
        return super().generate(request_id, prompt, sampling_params, **kwargs)
