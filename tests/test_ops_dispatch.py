"""Backend selection: auto picks by device and batch shape, explicit requests fail loudly when impossible."""

from __future__ import annotations

import pytest
import torch

from paged_backend import ops
from paged_backend.errors import BackendUnavailable
from tests._ops_cases import CASES, build_case, naive_attention, tolerance


def test_explicit_cuda_backend_on_cpu_tensors_says_why():
    built = build_case(CASES[0])
    with pytest.raises(BackendUnavailable, match="'cuda'") as raised:
        ops.paged_attention(*built.attention_args(), backend="cuda")
    assert "torch" in str(raised.value) or "CUDA" in str(raised.value)


def test_triton_on_cpu_tensors_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ops.unavailable_reason.cache_clear()  # availability is cached per process; re-read the variable
    try:
        with pytest.raises(BackendUnavailable, match="TRITON_INTERPRET"):
            ops.resolve_backend("triton", torch.device("cpu"))
    finally:
        monkeypatch.undo()
        ops.unavailable_reason.cache_clear()


def test_unknown_backend_lists_the_choices():
    with pytest.raises(BackendUnavailable, match="torch, cpu, triton, cuda"):
        ops.resolve_backend("flash", torch.device("cpu"))


def test_env_var_selects_backend(monkeypatch):
    monkeypatch.setenv(ops.ENV_VAR, "torch")
    assert ops.resolve_backend(None, torch.device("cpu")) == "torch"
    monkeypatch.setenv(ops.ENV_VAR, "cuda")
    with pytest.raises(BackendUnavailable, match="'cuda'"):
        ops.resolve_backend(None, torch.device("cpu"))


def test_argument_overrides_env_var(monkeypatch):
    monkeypatch.setenv(ops.ENV_VAR, "cuda")
    assert ops.resolve_backend("torch", torch.device("cpu")) == "torch"


@pytest.mark.parametrize("backend", [None, "torch", "cpu"])
def test_cpu_backends_match_naive_attention(backend: str | None, monkeypatch):
    monkeypatch.delenv(ops.ENV_VAR, raising=False)
    case = CASES[4]
    built = build_case(case)
    out = ops.paged_attention(*built.attention_args(), backend=backend)
    torch.testing.assert_close(out, naive_attention(case, built), **tolerance(case))


def test_cpu_only_machine_reports_cuda_unavailable_with_a_sentence(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU-only machine, also on a GPU box
    ops.unavailable_reason.cache_clear()
    try:
        reason = ops.unavailable_reason("cuda")
    finally:
        ops.unavailable_reason.cache_clear()  # later tests must see this machine's real answer
    assert reason and "CUDA device" in reason


@pytest.mark.parametrize("triton_missing", [False, True])
def test_auto_on_gpu_picks_triton_and_falls_back_to_cuda_for_decode_only(monkeypatch, triton_missing):
    # the decision alone, so it runs on any machine: which backends are available is what the test sets
    available = {"cuda"} if triton_missing else {"cuda", "triton"}
    monkeypatch.setattr(ops, "unavailable_reason", lambda name: None if name in available else "missing here")
    monkeypatch.delenv(ops.ENV_VAR, raising=False)
    device = torch.device("cuda")
    assert ops.resolve_backend(None, device, decode_only=True) == ("cuda" if triton_missing else "triton")
    assert ops.resolve_backend(None, device, decode_only=False) == ("torch" if triton_missing else "triton")


def test_the_invariant_default_traces_under_torch_compile():
    # Dynamo cannot trace the ContextVar read behind the default: a compiled caller reads it once, when traced
    from paged_backend.ops._contract import AttentionBatch

    def with_invariant_flag(x):
        return x + AttentionBatch(x, x, x, x, x, x, 1.0).invariant

    torch._dynamo.reset()
    compiled = torch.compile(with_invariant_flag, fullgraph=True, backend="eager")
    with ops.batch_invariant():
        assert compiled(torch.zeros(1)).item() == 1.0
