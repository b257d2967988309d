"""Paged attention and cache-write ops: one dispatcher over three backends.

Backends: ``torch`` (the oracle), ``cpu`` (the fused csrc/cpu kernel), ``triton`` and ``cuda``. Choose one
with the ``backend=`` argument, the ``PAGED_BACKEND_ATTENTION`` environment variable, or let auto-selection
pick (triton on GPU, measured faster than the csrc decode kernel on every decode shape of the H200 grid in
benchmarks/RESULTS.md, with cuda as the decode fallback where Triton is missing; cpu on CPU, torch where the CPU
kernel cannot be built).
``triton`` takes CPU tensors only under Triton's interpreter (``TRITON_INTERPRET=1``). Every backend module exposes
``unavailable_reason() -> str | None``, ``paged_attention`` and ``reshape_and_cache``: each backend writes
its kernels against the prepared arguments of :mod:`paged_backend.ops._contract` (``AttentionBatch``,
``CacheWrite``), which also give them this module's call form (without ``backend=``).

Batch-invariant attention (``invariant=True``, or any call inside ``with batch_invariant():``) runs on the
``cpu`` backend and on ``triton`` (one query token per program); asking another backend for it raises
`BackendUnavailable`.

Inside a forward every layer asks the dispatcher the same question of the same step: `StepAttention` answers it once,
at the first layer's call, and keeps what a backend prepares per step (the cpu backend's argument structs).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from functools import cache
from types import ModuleType

import torch

from paged_backend.config.env import env_choice
from paged_backend.errors import BackendUnavailable
from paged_backend.ops._contract import batch_invariant, batch_invariant_enabled, is_decode_batch
from paged_backend.ops.triton import triton_interpreted

BACKENDS = ("torch", "cpu", "triton", "cuda")
ENV_VAR = "PAGED_BACKEND_ATTENTION"
_MODULES = {"torch": "reference", "cpu": "cpu", "triton": "triton", "cuda": "cuda"}
INVARIANT_BACKENDS = ("cpu", "triton")  # the backends whose kernels honour `invariant` (see AttentionBatch)


@cache
def _module(name: str) -> ModuleType:
    return importlib.import_module(f"paged_backend.ops.{_MODULES[name]}")


@cache
def unavailable_reason(name: str) -> str | None:
    """None when backend `name` can run here, else a sentence saying why not."""
    if name not in BACKENDS:
        return f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}"
    if name == "torch":
        return None
    try:
        module = _module(name)
    except ImportError as exc:
        return f"the {name} backend could not be imported ({exc}); install paged-backend[{name}]"
    return module.unavailable_reason()


def asked_backend(name: str | None) -> str | None:
    """The backend asked for: `name`, else the one PAGED_BACKEND_ATTENTION names (an unknown one refused as the
    variable's), else None."""
    return name or env_choice(ENV_VAR, ("auto", *BACKENDS))


def resolve_backend(name: str | None, device: torch.device, *, decode_only: bool = False) -> str:
    """The backend to run: the one asked for (checked), else the best available for `device`."""
    if name or not os.environ.get(ENV_VAR):
        return _resolve(name, device, decode_only)
    try:
        return _resolve(asked_backend(None), device, decode_only)
    except BackendUnavailable as error:
        raise BackendUnavailable(f"{ENV_VAR}={os.environ[ENV_VAR]}: {error}") from None


def _resolve(name: str | None, device: torch.device, decode_only: bool) -> str:
    if name and name != "auto":
        reason = unavailable_reason(name)
        if reason:
            raise BackendUnavailable(f"attention backend {name!r} is unavailable: {reason}")
        if name == "cuda" and device.type != "cuda":
            raise BackendUnavailable(
                f"attention backend 'cuda' needs CUDA tensors, got {device.type}; "
                f"use backend='cpu' or 'torch', or move the model to a GPU"
            )
        if name == "triton" and device.type != "cuda" and not triton_interpreted():
            raise BackendUnavailable(
                f"attention backend 'triton' needs CUDA tensors, got {device.type}; use backend='cpu' or "
                f"'torch', move the model to a GPU, or set TRITON_INTERPRET=1 to run Triton's CPU interpreter"
            )
        if name == "cpu" and device.type != "cpu":
            raise BackendUnavailable(f"attention backend 'cpu' needs CPU tensors, got {device.type}; "
                                     f"use backend='triton' or 'cuda'")
        return name
    if device.type == "cpu":
        return "cpu" if unavailable_reason("cpu") is None else "torch"
    if device.type != "cuda":
        return "torch"
    preferred = ("triton", "cuda") if decode_only else ("triton",)
    for candidate in preferred:
        if unavailable_reason(candidate) is None:
            return candidate
    return "torch"


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, *, k_scale=1.0, v_scale=1.0,
                      backend: str | None = None) -> None:
    """Write `key/value [T, Hkv, D]` into the pools at `slot_mapping [T]` (slot -1 skipped)."""
    chosen = resolve_backend(backend, key.device)
    _module(chosen).reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                                      k_scale=k_scale, v_scale=v_scale)


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, *,
                    sliding_window: int | None = None, softcap: float | None = None,
                    k_scale: float = 1.0, v_scale: float = 1.0, invariant: bool | None = None,
                    backend: str | None = None) -> torch.Tensor:
    """Varlen causal paged attention; `query [T, Hq, D]` -> `[T, Hq, D]`. The contract is `AttentionBatch`
    (`invariant` None: whether the call is inside `batch_invariant()`)."""
    chosen = resolve_backend(backend, query.device, decode_only=is_decode_batch(query, seq_lens))
    invariant = batch_invariant_enabled() if invariant is None else invariant
    if invariant:
        _check_invariant_backend(chosen, query.device)
    return _module(chosen).paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
        sliding_window=sliding_window, softcap=softcap, k_scale=k_scale, v_scale=v_scale, invariant=invariant,
    )


class StepAttention:
    """`reshape_and_cache` and `paged_attention` for every layer of one forward over the same slots, block tables,
    lengths and query starts: the backend is chosen at the first layer's call, from its tensors as the functions
    would, and a backend's per-step state (the cpu backend's `CacheWriter` and `StepPlans`: the step's arguments in
    the kernels' structs) is built once, so a layer pays for the write and the kernel only. Backends that prepare
    nothing get the step's tensors with each call."""

    def __init__(self, slot_mapping, block_tables, seq_lens, query_start_loc, backend: str | None = None) -> None:
        self.slot_mapping, self.block_tables, self.seq_lens = slot_mapping, block_tables, seq_lens
        self.query_start_loc, self.backend = query_start_loc, backend
        self._write: Callable | None = None
        self._attend: Callable | None = None

    def write(self, key, value, key_cache, value_cache, *, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        """`reshape_and_cache(key, value, key_cache, value_cache, <the step's slots>, ...)`."""
        if self._write is None:
            module, slots = _module(resolve_backend(self.backend, key.device)), self.slot_mapping
            self._write = module.CacheWriter(slots) if hasattr(module, "CacheWriter") else (
                lambda *pools_and_rows, **scales: module.reshape_and_cache(*pools_and_rows, slots, **scales))
        self._write(key, value, key_cache, value_cache, k_scale=k_scale, v_scale=v_scale)

    def attend(self, query, key_cache, value_cache, scale: float, *, sliding_window: int | None = None,
               softcap: float | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        """`paged_attention(query, key_cache, value_cache, <the step's tables, lengths, starts>, scale, ...)`."""
        if self._attend is None:
            self._attend = self._attention(query)
        return self._attend(query, key_cache, value_cache, scale, sliding_window=sliding_window, softcap=softcap,
                            k_scale=k_scale, v_scale=v_scale)

    def _attention(self, query: torch.Tensor) -> Callable:
        tables, lens, starts = self.block_tables, self.seq_lens, self.query_start_loc
        chosen = resolve_backend(self.backend, query.device, decode_only=is_decode_batch(query, lens))
        invariant = batch_invariant_enabled()  # a forward runs inside the mode or outside it, all its layers alike
        if invariant:
            _check_invariant_backend(chosen, query.device)
        module = _module(chosen)
        if hasattr(module, "StepPlans"):
            return module.StepPlans(tables, lens, starts, invariant=invariant)
        return lambda query, key_cache, value_cache, scale, **options: module.paged_attention(
            query, key_cache, value_cache, tables, lens, starts, scale, invariant=invariant, **options)


def _check_invariant_backend(chosen: str, device: torch.device) -> None:
    if chosen not in INVARIANT_BACKENDS:
        raise BackendUnavailable(f"batch-invariant attention runs on the {' or '.join(INVARIANT_BACKENDS)} "
                                 f"backend, not {chosen!r}" + _why_not_cpu(chosen, device))


def _why_not_cpu(chosen: str, device: torch.device) -> str:
    if device.type != "cpu":
        return " (on a GPU: leave the attention backend on auto or triton)"
    reason = unavailable_reason("cpu")
    return f" ({reason})" if reason else " (leave the attention backend on auto or cpu)"


__all__ = [
    "BACKENDS", "INVARIANT_BACKENDS", "StepAttention", "batch_invariant", "batch_invariant_enabled", "paged_attention",
    "reshape_and_cache", "resolve_backend", "triton_interpreted", "unavailable_reason",
]
