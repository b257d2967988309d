"""fp8 KV pools in the engine on CPU: e4m3 and e5m2, per-layer scales from the first step, half the bytes of a
16-bit pool, and the fused CPU kernel reading them exactly as the torch oracle does."""

from __future__ import annotations

import copy

import pytest
import torch
from typer.testing import CliRunner

from paged_backend.cli import app as cli_app
from paged_backend.engine import LLM, SamplingParams
from paged_backend.worker.default_model import TINY_MODEL
from paged_backend.worker.models import byte_tokenizer, tiny_model

PROMPTS = [[5, 17, 42, 99, 7, 180, 33], [60 + i for i in range(21)], [9] * 12]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def engine(cache_dtype: str, **kwargs) -> LLM:
    model = tiny_model("qwen2", seed=5)
    return LLM(copy.deepcopy(model), tokenizer=byte_tokenizer(), device="cpu", num_blocks=32, block_size=4,
               cache_dtype=cache_dtype, **kwargs)  # fmt: skip


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_pool_halves_kv_bytes_and_the_cpu_kernel_matches_the_oracle(cache_dtype):
    fused = engine(cache_dtype, attention_backend="cpu", calculate_kv_scales=True)
    oracle = engine(cache_dtype, attention_backend="torch", calculate_kv_scales=True)
    assert fused.engine.kv_cache.bytes_per_block * 2 == engine("bfloat16").engine.kv_cache.bytes_per_block
    tokens = [[o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] for llm in (fused, oracle)]
    assert tokens[0] == tokens[1]
    manager = fused.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks - 1


def test_calculated_scales_are_per_layer_and_set_once():
    llm = engine("fp8_e5m2", calculate_kv_scales=True)
    cache = llm.engine.kv_cache
    assert cache.scales_pending == {0, 1}
    llm.generate(PROMPTS[:1], GREEDY)
    first = (list(cache.k_scales), list(cache.v_scales))
    assert not cache.scales_pending and len(set(first[0] + first[1])) == 4 and 1.0 not in first[0]
    llm.generate(PROMPTS[1:], GREEDY)
    assert (cache.k_scales, cache.v_scales) == first
    assert engine("bfloat16", calculate_kv_scales=True).engine.kv_cache.scales_pending == set()


def test_kv_cache_dtype_flags_on_run(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello\n")
    args = ["run", "--model", TINY_MODEL, "--device", "cpu", "--num-blocks", "32", "--max-tokens", "3", "--input", str(prompts),
            "--kv-cache-dtype", "fp8_e5m2", "--calculate-kv-scales"]  # fmt: skip
    assert CliRunner().invoke(cli_app, args).exit_code == 0
    bad = CliRunner().invoke(cli_app, [*args[:-3], "--kv-cache-dtype", "int3"])
    assert bad.exit_code == 2 and "fp8_e5m2" in bad.output


def test_e5m2_scale_keeps_large_values_finite():
    llm = engine("fp8_e5m2", calculate_kv_scales=True)
    kv = llm.engine.kv_cache
    llm.generate(PROMPTS, GREEDY)
    assert torch.isfinite(kv.kv.float()).all()


def test_serve_takes_the_kv_and_quantization_flags():
    import typer

    from paged_backend.engine.args import EngineArgs

    serve = typer.main.get_command(cli_app).commands["serve"]
    flags = {name for param in serve.params for name in param.opts}
    assert {"--kv-cache-dtype", "--calculate-kv-scales", "--quantization", "--quantization-param"} <= flags
    config = EngineArgs(cache_dtype="fp8_e5m2", calculate_kv_scales=True, quantization="torchao").to_engine_config()
    assert (config.cache.cache_dtype, config.cache.calculate_kv_scales, config.quantization) == (
        "fp8_e5m2", True, "torchao"
    )  # fmt: skip


def test_calculated_scale_stops_large_keys_saturating_e4m3():
    from paged_backend.core.kv_cache import PagedKVCache
    from paged_backend.core.kv_scales import calibrate_layer, start_calibration
    from paged_backend.ops.reference import reshape_and_cache

    key = torch.randn(8, 2, 16) * 1000  # far past e4m3's 448
    errors = []
    for calibrate in (False, True):
        cache = PagedKVCache(1, 2, 16, num_blocks=4, block_size=4, dtype=torch.float8_e4m3fn)
        if calibrate:
            start_calibration(cache)
            calibrate_layer(cache, 0, key, key)
        key_cache, value_cache = cache.layer(0)
        scale = cache.k_scales[0]
        reshape_and_cache(key, key, key_cache, value_cache, torch.arange(4, 12), k_scale=scale, v_scale=scale)
        stored = key_cache.view(-1, 2, 16)[4:12].float() * scale
        errors.append(float((stored - key).norm() / key.norm()))
    assert errors[0] > 0.3 and errors[1] < 0.05


def test_e5m2_is_refused_at_load_where_gpu_kernels_would_read_it():
    from paged_backend.core.kv_cache import check_kv_dtype_runs
    from paged_backend.errors import InvalidRequest

    for device, backend in ((torch.device("cuda"), None), (torch.device("cpu"), "triton")):
        with pytest.raises(InvalidRequest, match="fp8_e5m2 is read by the cpu and torch attention backends only"):
            check_kv_dtype_runs(torch.float8_e5m2, device, backend)
    check_kv_dtype_runs(torch.float8_e5m2, torch.device("cuda"), "torch")
    check_kv_dtype_runs(torch.float8_e4m3fn, torch.device("cuda"), None)
