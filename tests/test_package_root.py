"""The package root: `from paged_backend import LLM, SamplingParams` works as vLLM's line does, and importing the
package alone still loads no model stack (the engine's names load on first use)."""

from __future__ import annotations

import subprocess
import sys

import paged_backend
from paged_backend.worker.default_model import TINY_MODEL


def test_importing_the_package_loads_no_model_stack():
    code = "import sys, paged_backend; print('transformers' in sys.modules, 'paged_backend.engine.llm' in sys.modules)"
    said = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert said == ["False", "False"]


def test_the_vllm_style_import_generates():
    from paged_backend import LLM, SamplingParams
    from paged_backend.engine.llm import LLM as home

    assert LLM is home and {"LLM", "SamplingParams", "Logprob", "EngineArgs", "LoRARequest"} <= set(paged_backend.__all__)
    [output] = LLM(TINY_MODEL, device="cpu", num_blocks=32).generate(["Hi"], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(output.outputs[0].token_ids) == 3


def test_an_unknown_name_is_an_import_error():
    try:
        from paged_backend import LLMEngine  # noqa: F401
    except ImportError as error:
        assert "cannot import name 'LLMEngine'" in str(error)
    else:
        raise AssertionError("an unknown name was given")


def test_every_lazy_name_is_exported_and_loads():
    lazy = set(paged_backend._LAZY)
    assert lazy <= set(paged_backend.__all__)
    assert all(getattr(paged_backend, name) is not None for name in paged_backend.__all__)
