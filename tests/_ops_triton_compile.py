"""Compile every Triton kernel for real GPU targets and print one JSON line of results.

Runs as its own process (`python -m tests._ops_triton_compile`) because a process that imported
triton under TRITON_INTERPRET=1 holds interpreter versions of triton's own library functions.
"""

from __future__ import annotations

import json
import os

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from paged_backend.ops import _triton_attention, _triton_cache

ARCHS = (80, 90)
POINTER_TYPES = {"fp16": "*fp16", "bf16": "*bf16", "fp32": "*fp32", "fp8": "*u8"}
# (query dtype, pool dtype, head dim, group, BLOCK_M, segments), as paged_attention_split_kv picks them:
# decode split-KV, mixed batches (BLOCK_M 64 for 16-bit queries), fp8 pools, fp32, head dim 256
ATTENTION_CONFIGS = [
    ("bf16", "bf16", 128, 4, 16, 16),
    ("fp16", "fp16", 128, 8, 64, 1),
    ("bf16", "fp8", 128, 4, 64, 1),
    ("fp16", "fp8", 128, 8, 16, 16),
    ("bf16", "bf16", 256, 2, 64, 1),
    ("fp32", "fp32", 128, 4, 16, 1),
    ("fp32", "fp32", 256, 1, 16, 4),
]


def _compile(fn, arg_types: dict[str, str], constexprs: dict, arch: int) -> int:
    """Shared memory bytes of the compiled kernel."""
    signature = {name: "constexpr" if name in constexprs else arg_types.get(name, "i32") for name in fn.arg_names}
    positions = {(fn.arg_names.index(name),): value for name, value in constexprs.items()}
    kernel = triton.compile(ASTSource(fn, signature, constexprs=positions), target=GPUTarget("cuda", arch, 32))
    return kernel.metadata.shared


def _attention(config: tuple, arch: int) -> int:
    dtype, kv, head_dim, group, block_m, segments = config
    arg_types = {
        "out_ptr": POINTER_TYPES[dtype], "query_ptr": POINTER_TYPES[dtype],
        "key_cache_ptr": POINTER_TYPES[kv], "value_cache_ptr": POINTER_TYPES[kv],
        "partial_out_ptr": "*fp32", "partial_max_ptr": "*fp32", "partial_sum_ptr": "*fp32",
        "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
        "qk_scale": "fp32", "softcap": "fp32", "v_scale": "fp32",
    }
    constexprs = dict(
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim, BLOCK_SIZE=16, TILE=32, BLOCK_M=block_m,
        BLOCK_Q=block_m // group, NUM_SEGMENTS=segments, USE_SOFTCAP=True, USE_WINDOW=True,
        KV_FP8=kv == "fp8", DOT_PRECISION="ieee" if dtype == "fp32" else "tf32", UPCAST_DOT=False,
    )
    return _compile(_triton_attention.paged_attention_kernel, arg_types, constexprs, arch)


def _reduce(arch: int) -> int:
    arg_types = {"out_ptr": "*bf16", "partial_out_ptr": "*fp32", "partial_max_ptr": "*fp32",
                 "partial_sum_ptr": "*fp32", "v_scale": "fp32"}
    constexprs = dict(HEAD_DIM=128, HEAD_DIM_PAD=128, NUM_SEGMENTS=16)
    return _compile(_triton_attention.reduce_segments_kernel, arg_types, constexprs, arch)


def _cache(arch: int) -> int:
    arg_types = {"key_ptr": "*bf16", "value_ptr": "*bf16", "key_cache_ptr": "*u8", "value_cache_ptr": "*u8",
                 "slot_mapping_ptr": "*i64"}
    constexprs = dict(BLOCK_SIZE=16, NUM_HEADS=8, HEAD_DIM=128, HEADS_PAD=8, HEAD_DIM_PAD=128)
    return _compile(_triton_cache.reshape_and_cache_kernel, arg_types, constexprs, arch)


def config_id(kind: str, arch: int, config: tuple = ()) -> str:
    return "-".join([kind, f"sm{arch}", *map(str, config)])


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") != "1", "run without TRITON_INTERPRET"
    jobs = {config_id("attention", arch, c): (lambda c=c, a=arch: _attention(c, a))
            for arch in ARCHS for c in ATTENTION_CONFIGS}
    jobs |= {config_id("reduce", arch): (lambda a=arch: _reduce(a)) for arch in ARCHS}
    jobs |= {config_id("cache", arch): (lambda a=arch: _cache(a)) for arch in ARCHS}
    results = {}
    for name, job in jobs.items():
        try:
            results[name] = {"shared_bytes": job()}
        except Exception as exc:  # reported per kernel by the test
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[-3000:]}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
