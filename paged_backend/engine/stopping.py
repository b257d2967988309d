"""When a sequence stops, and why: EOS, stop token ids, stop strings, a finished grammar, the token budget.

One rule set for the engine and every TGI path. TGI's server decides two things differently from vLLM, and both are
parameters here rather than a second copy: it checks the token budget first (a last token that is also EOS ends with
"length"), and it matches a stop string only at the end of the text (its regex `stop$`, which also matches right
before a final newline) where vLLM finds one anywhere in the newly decoded text.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass


@dataclass(frozen=True)
class Stop:
    """vLLM's finish: "stop" (EOS, a stop token id or a stop string, named by `stop_reason`) or "length"."""

    reason: str
    stop_reason: int | str | None = None
    text_end: int | None = None  # a stop string's match: where the sequence's text is cut


@dataclass(frozen=True)
class StopRules:
    """The stopping rules of one request; `check` is called after each new token."""

    max_tokens: int
    eos_token_ids: Collection[int] = ()  # empty when the request ignores EOS
    stop: tuple[str, ...] = ()
    stop_token_ids: Collection[int] = ()
    min_tokens: int = 0  # EOS, stop ids and stop strings count only from this many output tokens on
    max_model_len: int | None = None  # prompt plus output
    include_stop_str_in_output: bool = False
    length_first: bool = False  # TGI: the budget is checked before anything else
    stop_at_end: bool = False  # TGI: a stop string counts only at the end of the text

    @classmethod
    def of(cls, params, eos_token_ids: Collection[int], max_model_len: int) -> StopRules:
        """The engine's rules for a request with these `SamplingParams`."""
        return cls(
            max_tokens=params.max_tokens,
            eos_token_ids=() if params.ignore_eos else frozenset(eos_token_ids),
            stop=tuple(params.stop),
            stop_token_ids=frozenset(params.stop_token_ids),
            min_tokens=params.min_tokens,
            max_model_len=max_model_len,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )

    def check(
        self, token: int, text: str, new_text: str, num_output_tokens: int, num_tokens: int = 0, grammar=None
    ) -> Stop | None:
        """Whether the sequence ends with `token`: `text` is its text so far (ending in `new_text`, this token's),
        `grammar` its structured-output matcher, if any (a finished grammar allows nothing more)."""
        if self.length_first and self.out_of_budget(num_output_tokens, num_tokens):
            return Stop("length")
        if num_output_tokens >= self.min_tokens:
            if token in self.eos_token_ids:
                return Stop("stop")
            if token in self.stop_token_ids:
                return Stop("stop", token)
            for stop in self.stop:
                at = self._find(stop, text, new_text)
                if at != -1:
                    return Stop("stop", stop, at + len(stop) if self.include_stop_str_in_output else at)
        if grammar is not None and grammar.is_terminated():
            return Stop("stop")
        if not self.length_first and self.out_of_budget(num_output_tokens, num_tokens):
            return Stop("length")
        return None

    def out_of_budget(self, num_output_tokens: int, num_tokens: int) -> bool:
        """max_tokens reached, or the context full."""
        return num_output_tokens >= self.max_tokens or (
            self.max_model_len is not None and num_tokens >= self.max_model_len
        )

    def _find(self, stop: str, text: str, new_text: str) -> int:
        """Where `stop` starts in the text, or -1."""
        if self.stop_at_end:
            for tail in (stop, stop + "\n"):
                if text.endswith(tail):
                    return len(text) - len(tail)
            return -1
        # Only the new text and the stop-string-long tail before it can hold a new match.
        return text.find(stop, max(0, len(text) - len(new_text) - len(stop) + 1))
