"""`speculative_config` with vLLM's field names: n-gram prompt lookup or a draft model."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SpeculativeConfig(BaseModel):
    """`{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m}` or
    `{"model": PATH_OR_MODEL_OBJECT, "num_speculative_tokens": k}`.

    >>> SpeculativeConfig(method="ngram", num_speculative_tokens=3).prompt_lookup_min
    1
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    method: Literal["ngram", "draft_model"] | None = None
    num_speculative_tokens: int = Field(..., ge=1, le=16, description="tokens proposed per step")
    prompt_lookup_max: int | None = Field(None, ge=1, description="longest suffix n-gram looked up")
    prompt_lookup_min: int | None = Field(None, ge=1, description="shortest suffix n-gram looked up")
    model: Any = Field(None, description="draft model: a directory, hub id or a loaded model object")
    disable_by_batch_size: int | None = Field(
        None, ge=1, description="no speculation in steps that run this many sequences or more (compute-bound)"
    )

    @model_validator(mode="after")
    def _resolve(self):
        if self.method is None:
            self.method = "draft_model" if self.model is not None else None
        if self.method is None:
            raise ValueError('speculative_config needs "method": "ngram" or a draft "model"')
        if self.method == "draft_model" and self.model is None:
            raise ValueError('speculative_config method "draft_model" needs "model": the draft model path')
        if self.method == "ngram":
            if self.prompt_lookup_max is None:
                self.prompt_lookup_max = self.prompt_lookup_min or 4
            if self.prompt_lookup_min is None:
                self.prompt_lookup_min = 1
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise ValueError("prompt_lookup_min must not exceed prompt_lookup_max")
        return self


def parse_speculative_config(value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """A CLI JSON string, a dict or a config (None stays None)."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(
                f'--speculative-config must be JSON, e.g. \'{{"method": "ngram", '
                f'"num_speculative_tokens": 3}}\' ({error})'
            ) from error
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f'speculative_config must be a JSON object such as {{"method": "ngram", '
                         f'"num_speculative_tokens": 3}}, not a {type(value).__name__}')  # fmt: skip
    return SpeculativeConfig(**value)
