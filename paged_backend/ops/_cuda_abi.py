"""ctypes mirror of csrc/paged_attention.h: argument structs, dtype codes, and the loaded library."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from paged_backend.ops._c_abi import F32, I32, I64, PAGED_KV_FIELDS, PTR, check_layouts

PARTITION_SIZE = 512  # PB_PARTITION_SIZE
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3}


class DecodeArgs(ctypes.Structure):
    _fields_ = [
        ("query", PTR), ("q_stride_seq", I64), ("q_stride_head", I64),
        *PAGED_KV_FIELDS,
        ("out", PTR), ("o_stride_seq", I64), ("o_stride_head", I64),
        ("partial_out", PTR), ("partial_max", PTR), ("partial_sum", PTR),
        ("num_seqs", I32), ("num_q_heads", I32), ("num_kv_heads", I32), ("head_dim", I32),
        ("block_size", I32), ("num_partitions", I32),
        ("scale", F32), ("softcap", F32), ("k_scale", F32), ("v_scale", F32),
        ("sliding_window", I32),
    ]


class CacheWriteArgs(ctypes.Structure):
    _fields_ = [
        ("key", PTR), ("value", PTR),
        ("key_stride_token", I64), ("key_stride_head", I64),
        ("value_stride_token", I64), ("value_stride_head", I64),
        ("key_cache", PTR), ("value_cache", PTR),
        ("kc_stride_block", I64), ("kc_stride_slot", I64), ("kc_stride_head", I64),
        ("vc_stride_block", I64), ("vc_stride_slot", I64), ("vc_stride_head", I64),
        ("slot_mapping", PTR),
        ("num_tokens", I32), ("num_heads", I32), ("head_dim", I32), ("block_size", I32),
        ("k_scale", F32), ("v_scale", F32),
    ]


def load_library(path: Path) -> ctypes.CDLL:
    """Load the built library, declare its signatures and check the struct layouts match ours."""
    lib = ctypes.CDLL(str(path))
    lib.pb_paged_decode.argtypes = [ctypes.POINTER(DecodeArgs), ctypes.c_int, ctypes.c_int, PTR]
    lib.pb_reshape_and_cache.argtypes = [ctypes.POINTER(CacheWriteArgs), ctypes.c_int, ctypes.c_int, PTR]
    lib.pb_paged_decode.restype = lib.pb_reshape_and_cache.restype = ctypes.c_int
    lib.pb_error_string.argtypes = [ctypes.c_int]
    lib.pb_error_string.restype = ctypes.c_char_p
    check_layouts(lib, {DecodeArgs: "pb_decode_args_size", CacheWriteArgs: "pb_cache_write_args_size"}, str(path))
    return lib
