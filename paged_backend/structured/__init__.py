"""Structured outputs: constraints compiled to token masks that the sampler applies to a whole batch at once."""

from paged_backend.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
