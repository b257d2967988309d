"""ctypes pieces both C ABIs share (csrc/ for CUDA, csrc/cpu/ for the host): scalar types, the paged K/V
fields each attention struct carries in the same order, and the checks around every library and call."""

from __future__ import annotations

import ctypes

import torch

I64, I32, F32, PTR = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p

# the pools `[num_blocks, block_size, Hkv, D]` with their first three strides, then the block tables
PAGED_KV_FIELDS = [
    ("key_cache", PTR), ("value_cache", PTR),
    ("k_stride_block", I64), ("k_stride_slot", I64), ("k_stride_head", I64),
    ("v_stride_block", I64), ("v_stride_slot", I64), ("v_stride_head", I64),
    ("block_tables", PTR), ("table_stride", I64), ("seq_lens", PTR),
]


def paged_kv_values(key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor) -> tuple:
    """The values of `PAGED_KV_FIELDS`, in its order."""
    return (
        key_cache.data_ptr(), value_cache.data_ptr(), *key_cache.stride()[:3], *value_cache.stride()[:3],
        block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(),
    )


def check_layouts(lib: ctypes.CDLL, sizes: dict[type, str], library: str) -> None:
    """Refuse a library whose structs differ in size from their ctypes mirrors (stale build or edited C).

    `sizes` maps each mirror to the library function returning the C struct's sizeof.
    """
    for struct, size_function in sizes.items():
        size_of = getattr(lib, size_function)
        size_of.restype = ctypes.c_uint64
        if size_of() != ctypes.sizeof(struct):
            raise RuntimeError(f"{library} disagrees with the ctypes layout of {struct.__name__}; rebuild it")


def check_status(status: int, error_string, what: str) -> None:
    """Raise the library's own words for a nonzero status."""
    if status != 0:
        raise RuntimeError(f"{what} failed: {error_string(status).decode()}")
