"""The sampling defaults an engine gives the fields a request leaves out (`--generation-config`, vLLM's rule): the
model's generation_config.json ("auto"), none ("vllm") or a folder's, with `--override-generation-config` over
them. Read once, when the engine is built; the servers and `LLM.get_default_sampling_params` take them from there."""

from __future__ import annotations

import os
import sys

from transformers import GenerationConfig

from paged_backend.config import EngineConfig
from paged_backend.config.generation import sampling_defaults
from paged_backend.engine.sampling_params import SamplingParams
from paged_backend.errors import InvalidRequest


def read_sampling_defaults(config: EngineConfig, model) -> dict:
    """SamplingParams fields -> the default each takes when a request leaves it out (only those the source sets)."""
    source = config.generation_config
    if source == "vllm":
        given = {}
    elif source == "auto":
        generation = getattr(model, "generation_config", None)
        given = {} if generation is None else generation.to_diff_dict()  # what differs from transformers' defaults
    elif not os.path.isdir(source):
        raise InvalidRequest(f"--generation-config {source!r} is neither auto, vllm nor a folder")
    else:
        try:
            given = GenerationConfig.from_pretrained(source).to_diff_dict()
        except (OSError, ValueError) as error:
            raise InvalidRequest(f"--generation-config {source!r}: no readable generation_config.json there "
                                 f"({str(error).splitlines()[0]})") from error  # fmt: skip
    defaults = sampling_defaults({**given, **(config.override_generation_config or {})})
    try:
        SamplingParams(**defaults)
    except InvalidRequest as error:
        raise InvalidRequest(f"the generation config's sampling defaults {defaults} are not valid: {error}") from error
    if defaults and source != "vllm":
        print(f"paged-backend: sampling defaults from the generation config: {defaults} (a request's own values win; "
              "--generation-config vllm to leave them out)", file=sys.stderr)  # fmt: skip
    return defaults
