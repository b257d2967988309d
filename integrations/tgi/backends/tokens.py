"""Token-level semantics shared by every TGI path: incremental detokenization and stopping criteria.

Both follow TGI's server (`Model.decode_token`, `StoppingCriteria`), so the HTTP face, the reference
backend and the gRPC shard agree on token texts and finish reasons.
"""

from __future__ import annotations

import re

from paged_backend.tgi.backends.base import FinishReason

# TGI starts decoding 5 tokens before the first new one so merges with the prompt's tail render right.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Text of each new token: the growth of a short decoded window; '' while a UTF-8 char is incomplete."""

    def __init__(self, tokenizer, prompt_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids)
        self.prefix_offset = max(len(self.ids) - _CONTEXT_TOKENS, 0)
        self.read_offset = len(self.ids)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=False)
        new_text = decode(self.ids[self.prefix_offset :], skip_special_tokens=False)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return new_text[len(prefix_text) :]
        return ""


def eos_token_ids(tokenizer, generation_config=None) -> set[int]:
    """EOS ids from the generation config (may be a list), else the tokenizer's."""
    configured = getattr(generation_config, "eos_token_id", None)
    if configured is None:
        configured = tokenizer.eos_token_id
    if configured is None:
        return set()
    return set(configured) if isinstance(configured, list | tuple) else {configured}


class StoppingCriteria:
    """Decides after each token: length first, then EOS, then stop sequences matched at the text's end."""

    _KEEP_CHARS, _TRIM_AT = 200, 300

    def __init__(
        self, eos_ids: set[int], stop_sequences: tuple[str, ...], max_new_tokens: int, ignore_eos: bool = False
    ) -> None:
        self.eos_ids = eos_ids
        self.patterns = [re.compile(re.escape(stop) + "$") for stop in stop_sequences]
        self.max_new_tokens = max_new_tokens
        self.ignore_eos = ignore_eos
        self.current_tokens = 0
        self.current_output = ""

    def __call__(self, token_id: int, token_text: str) -> FinishReason | None:
        self.current_tokens += 1
        if self.current_tokens >= self.max_new_tokens:
            return "length"
        if not self.ignore_eos and token_id in self.eos_ids:
            return "eos_token"
        if self.patterns:
            self.current_output += token_text
            if len(self.current_output) > self._TRIM_AT:
                self.current_output = self.current_output[-self._KEEP_CHARS :]
            if any(pattern.search(self.current_output) for pattern in self.patterns):
                return "stop_sequence"
        return None
