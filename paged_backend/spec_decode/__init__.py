"""Speculative decoding: proposers (n-gram lookup, draft model), a rejection sampler, and the step-level glue.

The engine's contract is three calls on `Speculator`: `propose` (drafts for this step's decodes, their slots
appended), `verify` (accepted tokens plus one from the target's rows) and `retain` (drop draft state of sequences
that are gone). Rejected tokens roll back through `BlockManager.truncate`.
"""

from paged_backend.config.speculative import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
