"""The engine's structured-output manager: compiles constraints (cached by content), hands out per-sequence matchers,
and masks a whole batch's logits in one fill and one apply.

Grammar engine: llguidance (chosen over xgrammar by measurement, see benchmarks/RESULTS.md "Structured outputs":
a dozen JSON schemas compile in ~10 ms against ~1 s at a 32k vocabulary, with a similar batch-64 mask time and a
tighter tail). The apply kernel is xgrammar's (C++ on CPU, Triton on CUDA), ~3x faster on CPU than unpacking the
bits with torch ops.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import llguidance
import llguidance.hf
import torch
from llguidance.torch import fill_next_token_bitmask_par
from xgrammar import apply_token_bitmask_inplace

from paged_backend.errors import InvalidRequest
from paged_backend.structured.grammars import llguidance_grammar
from paged_backend.structured.matcher import Matcher
from paged_backend.structured.params import StructuredOutputsParams


class StructuredOutputManager:
    """One per engine: the tokenizer's grammar view, an LRU of compiled constraints and the batch mask buffer.

    >>> from paged_backend.worker.models import byte_tokenizer
    >>> manager = StructuredOutputManager(byte_tokenizer(), vocab_size=256, eos_token_ids={254})
    >>> matcher = manager.new_matcher(StructuredOutputsParams(choice=["yes", "no"]))
    >>> all(matcher.accept(t) for t in b"yes"), matcher.is_terminated()
    (True, True)
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: set[int], cache_size: int = 128) -> None:
        if not hasattr(tokenizer, "backend_tokenizer"):
            raise InvalidRequest(
                f"structured outputs need a fast (tokenizers-backed) tokenizer; {type(tokenizer).__name__} is not one"
            )
        self.vocab_size = vocab_size
        # The mask covers every id the model can emit and every id the tokenizer knows, whichever is wider.
        n_vocab = max(vocab_size, len(tokenizer))
        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=n_vocab, eos_token=sorted(eos_token_ids) or None
        )
        self._executor = llguidance.LLExecutor()
        self._words = (n_vocab + 31) // 32
        self._bitmask = torch.empty(0, self._words, dtype=torch.int32)
        self.cache_size = cache_size
        self._compiled: OrderedDict[tuple, llguidance.LLMatcher] = OrderedDict()
        self.cache_hits = 0
        self.cache_misses = 0

    def validate(self, params: StructuredOutputsParams) -> None:
        """Compile `params` (or find it compiled); raises `InvalidRequest` naming what is wrong with it."""
        self._compile(params)

    def new_matcher(self, params: StructuredOutputsParams) -> Matcher:
        """A fresh matcher at the grammar's start: a copy of the compiled one (microseconds after the compile)."""
        return Matcher(self._compile(params).deep_copy())

    def apply_masks(self, logits: torch.Tensor, matchers: list[Matcher | None]) -> None:
        """Set the tokens each row's grammar forbids to -inf, in place; rows whose matcher is None are untouched.

        One parallel bitmask fill for the batch, one apply kernel over the rows that have a matcher.
        """
        rows = [i for i, matcher in enumerate(matchers) if matcher is not None]
        if not rows:
            return
        batch, width = logits.shape
        bitmask = self._bitmask_rows(batch)
        fill_next_token_bitmask_par(
            self._executor, [(matchers[i].llguidance_matcher, i) for i in rows], bitmask
        )
        target = logits if logits.is_contiguous() else logits.contiguous()
        masked_width = min(width, self._words * 32)
        apply_token_bitmask_inplace(
            target, bitmask.to(logits.device), vocab_size=masked_width, indices=None if len(rows) == batch else rows
        )
        if width > masked_width:  # ids past the tokenizer and the model's vocab_size cannot be grammatical
            target[rows, masked_width:] = float("-inf")
        if target is not logits:
            logits.copy_(target)

    def _compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The compiled matcher for `params`, kept at its start state as the template every sequence copies."""
        key = params.cache_key()
        compiled = self._compiled.get(key)
        if compiled is not None:
            self._compiled.move_to_end(key)
            self.cache_hits += 1
            return compiled
        self.cache_misses += 1
        compiled = llguidance.LLMatcher(self._tokenizer, llguidance_grammar(params), log_level=0)
        if compiled.is_error():
            raise InvalidRequest(f"structured-output {params.kind} cannot be compiled: {compiled.get_error()}")
        # The first mask, computed once here: a constraint that matches no text at all fails only when asked for it
        # (the start state's first token then has nothing to come from)
        fill_next_token_bitmask_par(self._executor, [(compiled, 0)], self._bitmask_rows(1))
        if compiled.is_error():
            reason = compiled.get_error().splitlines()[0]
            raise InvalidRequest(f"structured-output {params.kind} matches no text ({reason}); check the constraint")
        self._compiled[key] = compiled
        if len(self._compiled) > self.cache_size:
            self._compiled.popitem(last=False)
        return compiled

    def _bitmask_rows(self, batch: int) -> torch.Tensor:
        """The first `batch` rows of a reused int32 bitmask buffer (grown by doubling)."""
        if self._bitmask.shape[0] < batch:
            self._bitmask = torch.empty(max(batch, 2 * self._bitmask.shape[0]), self._words, dtype=torch.int32)
        return self._bitmask[:batch]
