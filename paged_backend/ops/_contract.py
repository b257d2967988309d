"""The arguments of the two ops, declared once: every backend receives them prepared as one object.

`AttentionBatch` and `CacheWrite` are the call contract of :func:`paged_backend.ops.paged_attention` and
:func:`paged_backend.ops.reshape_and_cache` (minus ``backend=``), with the shapes every kernel reads derived
in one place. A backend writes its kernel against the object and `called_as` gives it the public call form,
so ``reference.paged_attention(query, key_cache, ...)`` works the same in every backend module.

Batch-invariant attention (`AttentionBatch.invariant`) is asked for per call, or for every call inside
``with batch_invariant():`` (what the engine's batch-invariant mode wraps each forward in), so callers
that build the arguments deep inside a model need no extra parameter.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import KW_ONLY, dataclass, field

import torch

_BATCH_INVARIANT = ContextVar("paged_backend_batch_invariant", default=False)


@contextmanager
def batch_invariant(enabled: bool = True) -> Iterator[None]:
    """Attention calls inside default to `invariant=enabled` (this thread or task only)."""
    token = _BATCH_INVARIANT.set(enabled)
    try:
        yield
    finally:
        _BATCH_INVARIANT.reset(token)


# torch.compile cannot trace a ContextVar read: a compiled caller reads the mode once, when it is traced.
@torch.compiler.assume_constant_result
def batch_invariant_enabled() -> bool:
    """Whether attention calls here default to batch-invariant (inside `batch_invariant()`)."""
    return _BATCH_INVARIANT.get()


def is_decode_batch(query: torch.Tensor, seq_lens: torch.Tensor) -> bool:
    """One new token per sequence: the batches the cuda kernel runs and Triton may split along KV."""
    return query.shape[0] == seq_lens.shape[0]


def max_context(block_tables: torch.Tensor, block_size: int) -> int:
    """The longest context the block tables can address: an upper bound known without a device sync."""
    return block_tables.shape[1] * block_size


@dataclass(slots=True)
class AttentionBatch:
    """Varlen causal paged attention over NHD pools `[num_blocks, block_size, Hkv, D]`.

    `query [T, Hq, D]` holds the new tokens of B sequences back to back: sequence b owns rows
    `query_start_loc[b]:query_start_loc[b + 1]`, attends causally over its `seq_lens[b]` tokens (the new
    ones last) stored in the blocks `block_tables[b]`. `softcap`/`sliding_window` None mean off; fp8 pools
    hold keys divided by `k_scale` and values divided by `v_scale`. `invariant`: each output row is computed
    in the same order whatever the other rows, the query length or the chunking (bitwise equal alone or in
    a batch); default: inside `batch_invariant()` or not.
    """

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float
    _: KW_ONLY
    sliding_window: int | None = None
    softcap: float | None = None
    k_scale: float = 1.0
    v_scale: float = 1.0
    invariant: bool = field(default_factory=batch_invariant_enabled)

    @property
    def group(self) -> int:
        """Query heads per kv head (GQA)."""
        return self.query.shape[1] // self.key_cache.shape[2]

    @property
    def decode_only(self) -> bool:
        return is_decode_batch(self.query, self.seq_lens)

    @property
    def max_context(self) -> int:
        return max_context(self.block_tables, self.key_cache.shape[1])


@dataclass(slots=True)
class CacheWrite:
    """Rows `key/value [T, Hkv, D]` to store at pool slots `slot_mapping [T]` (-1: padding, skipped).

    A slot is `block * block_size + offset`; fp8 pools store `key / k_scale` and `value / v_scale`.
    """

    key: torch.Tensor
    value: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    slot_mapping: torch.Tensor
    _: KW_ONLY
    k_scale: float = 1.0
    v_scale: float = 1.0


def called_as(contract: type) -> Callable[[Callable], Callable]:
    """Decorator: `kernel(prepared)` becomes callable with `contract`'s own signature (the public form)."""

    def decorate(kernel: Callable) -> Callable:
        @functools.wraps(kernel)
        def public_form(*args, **kwargs):
            return kernel(contract(*args, **kwargs))

        returns = inspect.signature(kernel).return_annotation
        public_form.__signature__ = inspect.signature(contract).replace(return_annotation=returns)
        return public_form

    return decorate


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """Kernels read head_dim as one contiguous row; copy only when it is not."""
    return t if t.stride(-1) == 1 else t.contiguous()


def as_int32(t: torch.Tensor) -> torch.Tensor:
    """Index tensors as the C kernels take them: contiguous int32."""
    return t.to(dtype=torch.int32).contiguous()
