"""vLLM's `--generation-config` and `--override-generation-config`: where the sampling defaults of the fields a
request leaves out come from. vLLM reads them from the model's generation_config.json ("auto", its default), so an
instruct model samples as its authors set it (Qwen2.5: temperature 0.7, top_p 0.8, top_k 20, ...) unless the request
says otherwise; "vllm" keeps SamplingParams' own defaults; a folder is read instead of the model's."""

from __future__ import annotations

import json
import numbers

# generation_config's name -> SamplingParams' (the fields vLLM reads; max_new_tokens is the default max_tokens)
GENERATION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                     "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}  # fmt: skip


def parse_override(value: str | dict | None) -> dict | None:
    """`--override-generation-config`: a JSON object of generation_config fields, e.g. '{"temperature": 0.5}'."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"must be a JSON object such as '{{\"temperature\": 0.5}}' ({error})") from error
    if not isinstance(value, dict):
        raise ValueError(f"must be a JSON object such as '{{\"temperature\": 0.5}}', not a {type(value).__name__}")
    for key, field in value.items():
        if key not in GENERATION_FIELDS:
            raise ValueError(f"unknown field {key!r}; it takes {', '.join(GENERATION_FIELDS)}")
        if not isinstance(field, numbers.Real) or isinstance(field, bool):
            raise ValueError(f"{key} must be a number, got {field!r}")
    return value


def sampling_defaults(given: dict) -> dict:
    """SamplingParams fields from generation_config fields (unset or null ones left out)."""
    return {ours: given[theirs] for theirs, ours in GENERATION_FIELDS.items() if given.get(theirs) is not None}
