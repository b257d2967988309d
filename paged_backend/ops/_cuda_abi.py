"""ctypes mirror of csrc/paged_attention.h: argument structs, dtype codes, and the loaded library."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

PARTITION_SIZE = 512  # PB_PARTITION_SIZE
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3}

_i64, _i32, _f32, _ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p


class DecodeArgs(ctypes.Structure):
    _fields_ = [
        ("query", _ptr), ("q_stride_seq", _i64), ("q_stride_head", _i64),
        ("key_cache", _ptr), ("value_cache", _ptr),
        ("k_stride_block", _i64), ("k_stride_slot", _i64), ("k_stride_head", _i64),
        ("v_stride_block", _i64), ("v_stride_slot", _i64), ("v_stride_head", _i64),
        ("block_tables", _ptr), ("table_stride", _i64), ("seq_lens", _ptr),
        ("out", _ptr), ("o_stride_seq", _i64), ("o_stride_head", _i64),
        ("partial_out", _ptr), ("partial_max", _ptr), ("partial_sum", _ptr),
        ("num_seqs", _i32), ("num_q_heads", _i32), ("num_kv_heads", _i32), ("head_dim", _i32),
        ("block_size", _i32), ("num_partitions", _i32),
        ("scale", _f32), ("softcap", _f32), ("k_scale", _f32), ("v_scale", _f32),
        ("sliding_window", _i32),
    ]


class CacheWriteArgs(ctypes.Structure):
    _fields_ = [
        ("key", _ptr), ("value", _ptr),
        ("key_stride_token", _i64), ("key_stride_head", _i64),
        ("value_stride_token", _i64), ("value_stride_head", _i64),
        ("key_cache", _ptr), ("value_cache", _ptr),
        ("kc_stride_block", _i64), ("kc_stride_slot", _i64), ("kc_stride_head", _i64),
        ("vc_stride_block", _i64), ("vc_stride_slot", _i64), ("vc_stride_head", _i64),
        ("slot_mapping", _ptr),
        ("num_tokens", _i32), ("num_heads", _i32), ("head_dim", _i32), ("block_size", _i32),
        ("k_scale", _f32), ("v_scale", _f32),
    ]


def load_library(path: Path) -> ctypes.CDLL:
    """Load the built library, declare its signatures and check the struct layouts match ours."""
    lib = ctypes.CDLL(str(path))
    lib.pb_paged_decode.argtypes = [ctypes.POINTER(DecodeArgs), ctypes.c_int, ctypes.c_int, _ptr]
    lib.pb_reshape_and_cache.argtypes = [ctypes.POINTER(CacheWriteArgs), ctypes.c_int, ctypes.c_int, _ptr]
    lib.pb_paged_decode.restype = lib.pb_reshape_and_cache.restype = ctypes.c_int
    lib.pb_error_string.argtypes = [ctypes.c_int]
    lib.pb_error_string.restype = ctypes.c_char_p
    lib.pb_decode_args_size.restype = lib.pb_cache_write_args_size.restype = ctypes.c_uint64
    for struct, size_of in ((DecodeArgs, lib.pb_decode_args_size), (CacheWriteArgs, lib.pb_cache_write_args_size)):
        if ctypes.sizeof(struct) != size_of():
            raise RuntimeError(f"{path} disagrees with the ctypes layout of {struct.__name__}; rebuild csrc/")
    return lib


def check(lib: ctypes.CDLL, status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed: {lib.pb_error_string(status).decode()}")
