"""One sequence's position in its grammar."""

from __future__ import annotations

import llguidance


class Matcher:
    """Tracks the tokens a sequence has generated against its compiled grammar.

    Made by `StructuredOutputManager.new_matcher`; the engine calls `accept` after each sampled token and finishes
    the sequence once `is_terminated()`.
    """

    __slots__ = ("_matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (and a matcher that only allows EOS from then on) if it was not allowed."""
        return self._matcher.consume_token(token_id)

    def error(self) -> str | None:
        """What the grammar engine failed on (a limit of its own, such as a huge repetition count), if it did."""
        return self._matcher.get_error() if self._matcher.is_error() else None

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative drafts walked to mask their rows)."""
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        """The grammar is complete: EOS was accepted, or nothing but EOS can follow."""
        return self._matcher.is_stopped()

    @property
    def llguidance_matcher(self) -> llguidance.LLMatcher:
        """The backend object, for the manager's batched mask fill."""
        return self._matcher
