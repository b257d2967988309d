"""The cuda backend's torch.library ops are registered with the right schemas and usable fake kernels.

Runs without a GPU: fake tensors only carry shapes, so this is what torch.compile and CUDA-graph capture see.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import paged_backend.ops.cuda  # noqa: F401  (registers the ops)


def test_ops_are_registered_with_mutation_annotations():
    decode = str(torch.ops.paged_backend.paged_decode.default._schema)
    write = str(torch.ops.paged_backend.reshape_and_cache.default._schema)
    assert decode.endswith("-> Tensor")
    assert "!) key_cache" in write and "!) value_cache" in write and write.endswith("-> ()")
    assert "!" not in decode  # decode mutates nothing: safe to reorder or capture


def test_fake_decode_returns_query_shaped_output():
    with FakeTensorMode():
        query = torch.empty(3, 32, 128, device="cuda", dtype=torch.bfloat16)
        pool = torch.empty(64, 16, 8, 128, device="cuda", dtype=torch.float8_e4m3fn)
        tables = torch.zeros(3, 4, dtype=torch.int32, device="cuda")
        seq_lens = torch.ones(3, dtype=torch.int32, device="cuda")
        out = torch.ops.paged_backend.paged_decode(query, pool, pool, tables, seq_lens, 0.1, 0, 0.0, 1.0, 1.0)
    assert out.shape == query.shape and out.dtype == query.dtype and out.device.type == "cuda"
