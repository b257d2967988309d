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
        if logger.isEnabledFor(logging.INFO):
            token_ids = kwargs.get("prompt_token_ids")
            if isinstance(prompt, dict):  # vLLM's {"prompt": ...} / {"prompt_token_ids": ...}
                token_ids, prompt = prompt.get("prompt_token_ids", token_ids), prompt.get("prompt")
            elif isinstance(prompt, list):
                token_ids, prompt = prompt, None
            cut = self.max_log_len
            if prompt is None and token_ids is not None:  # the text the ids stand for (chat: the rendered template)
                prompt = self.engine.tokenizer.decode(token_ids if cut is None else token_ids[:cut])
            logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s, lora_request: %s.",
                        request_id, prompt if cut is None or prompt is None else prompt[:cut], sampling_params,
                        token_ids if cut is None or token_ids is None else token_ids[:cut],
                        kwargs.get("lora_request"))  # fmt: skip
        return super().generate(request_id, prompt, sampling_params, **kwargs)


