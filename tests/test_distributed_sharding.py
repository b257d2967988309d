"""shard_model: each rank keeps its heads and MLP columns, and the ranks' sum is the whole model's output.

Two gloo ranks run in forked processes (1 thread each); the sharded logits equal the unsharded model's within
fp32 tolerance (the all-reduce sums partial products in a different order, so not bit-exact).
"""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from paged_backend.core.kv_budget import KVShape
from paged_backend.distributed import check_shardable, shard_model
from paged_backend.errors import UnsupportedModel
from tests._hf_models import tiny_model

CASES = [("llama", {}), ("llama", {"num_key_value_heads": 1}), ("qwen2", {}), ("qwen3", {})]
INPUT = torch.tensor([[5, 17, 99, 3, 42, 8, 71]])


def _rank(rank: int, port: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        for index, (arch, overrides) in enumerate(CASES):
            model = shard_model(tiny_model(arch, **overrides), rank, 2)
            with torch.no_grad():
                results[(index, rank)] = model(INPUT).logits
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_rank_shards_sum_to_the_whole_model():
    results = mp.get_context("fork").Manager().dict()
    port = _free_port()
    procs = [mp.get_context("fork").Process(target=_rank, args=(r, port, results)) for r in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
    for index, (arch, overrides) in enumerate(CASES):
        with torch.no_grad():
            expected = tiny_model(arch, **overrides)(INPUT).logits
        for rank in range(2):
            torch.testing.assert_close(results[(index, rank)], expected, rtol=1e-5, atol=1e-5)


def test_rank_keeps_its_heads():
    model = tiny_model("llama", num_key_value_heads=1)
    full_q = model.model.layers[0].self_attn.q_proj.weight.clone()
    full_k = model.model.layers[0].self_attn.k_proj.weight.clone()
    shard_model(model, 1, 2)  # builds no collective: hooks only fire in forward
    attn = model.model.layers[0].self_attn
    assert torch.equal(attn.q_proj.weight, full_q[32:])  # heads 2 and 3 of 4 (head_dim 16)
    assert torch.equal(attn.k_proj.weight, full_k)  # the single KV head, replicated
    assert attn.o_proj.in_features == 32 and model.model.layers[0].mlp.down_proj.in_features == 64
    assert KVShape.of(model.config).per_rank(2).num_kv_heads == 1
    assert KVShape.of(tiny_model("llama").config).per_rank(2).num_kv_heads == 1


@pytest.mark.parametrize(
    "overrides, size, needle",
    [
        ({}, 3, "4 attention heads do not split over tensor_parallel_size=3"),
        (
            {"num_attention_heads": 12, "num_key_value_heads": 4, "hidden_size": 96, "intermediate_size": 132},
            6,
            "4 KV heads",
        ),
        ({"intermediate_size": 130}, 4, "MLP width 130"),
        ({}, 0, "at least 1"),
    ],
)
def test_unsupported_shapes_are_refused(overrides, size, needle):
    with pytest.raises(UnsupportedModel, match=needle):
        check_shardable(tiny_model("llama", **overrides), size)


def test_fused_plans_are_refused():
    model = tiny_model("phi3")  # qkv_proj / gate_up_proj are fused: its plan says so
    with pytest.raises(UnsupportedModel, match="does not shard"):
        check_shardable(model, 2)
