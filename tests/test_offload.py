"""Models placed by accelerate (device maps, max_memory, disk offload) run paged, token-identical to HF generate.

The engines ask for `dtype="float32"`, the reference's (`--dtype auto` is bfloat16 on CPUs with AMX or AVX512-BF16,
which would also halve the bytes the placement flags place)."""

import json

import pytest
import torch

pytest.importorskip("accelerate", reason="the [accelerate] extra is not installed")

from transformers import AutoModelForCausalLM  # noqa: E402

from paged_backend import InvalidRequest  # noqa: E402
from paged_backend.config.placement import parse_device_map, parse_max_memory  # noqa: E402
from paged_backend.engine import Engine, SamplingParams, engine_config  # noqa: E402
from paged_backend.hf import PagedCache  # noqa: E402
from paged_backend.worker.default_model import TINY_MODEL
from paged_backend.worker.models import byte_tokenizer, tiny_model  # noqa: E402
from paged_backend.worker.offload import layer_devices  # noqa: E402

# Layers 1 and 3 live on disk (accelerate streams their weights in at each forward), the rest in CPU memory.
DISK_MAP = {
    "model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.layers.2": "cpu",
    "model.layers.3": "disk", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu",
}  # fmt: skip
DTYPE = "float32"  # the HF reference's
PROMPTS = [[253, 72, 101, 108, 108, 111], [253, 87, 111, 114, 108, 100, 33, 32, 40, 50]]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("offload-model")
    tiny_model("llama", seed=3, num_layers=4).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return str(path)


def dispatched(model_dir, **placement):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **placement).eval()


def hf_greedy(model, prompt):
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=255)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def reference(model_dir):
    model = dispatched(model_dir, device_map=DISK_MAP)
    assert {p.device.type for p in model.model.layers[1].parameters()} == {"meta"}  # really on disk
    return [hf_greedy(model, prompt) for prompt in PROMPTS]


@pytest.mark.parametrize("attn", ["sdpa", "paged_backend"])
def test_paged_cache_on_a_disk_offloaded_model_matches_generate(model_dir, reference, attn):
    model = dispatched(model_dir, device_map=DISK_MAP)
    if attn == "paged_backend":
        from paged_backend.worker.attention import register_paged_attention

        model.set_attn_implementation(register_paged_attention())
    assert layer_devices(model, 4) == [torch.device("cpu")] * 4  # disk layers execute on the CPU
    for prompt, expected in zip(PROMPTS, reference, strict=True):
        cache = PagedCache(model, max_tokens=256)
        out = model.generate(torch.tensor([prompt]), past_key_values=cache, max_new_tokens=NEW_TOKENS,
                             do_sample=False, eos_token_id=None, pad_token_id=255)  # fmt: skip
        assert out[0, len(prompt) :].tolist() == expected
        cache.reset()
        assert cache.block_manager.num_free_blocks == cache.block_manager.num_blocks - 1


def test_engine_with_flags_offloads_to_disk_and_matches_generate(model_dir, reference):
    # The --device-map JSON exactly as the CLIs pass it.
    config = engine_config(model=model_dir, device="cpu", dtype=DTYPE, device_map=json.dumps(DISK_MAP), num_blocks=64)
    engine = Engine(config)
    assert engine.model.hf_device_map["model.layers.3"] == "disk"
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(str(index), prompt_token_ids=prompt, sampling_params=params)
    results = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output.outputs[0].token_ids
    assert [results[str(i)] for i in range(len(PROMPTS))] == reference
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks - 1


@pytest.mark.parametrize("placement", [{"cpu_offload_gb": 0.0002}, {"max_memory": "cpu=400KB"}])
def test_cpu_offload_gb_and_max_memory_move_weights_to_disk(model_dir, reference, placement):
    engine = Engine(engine_config(model=model_dir, device="cpu", dtype=DTYPE, num_blocks=32, **placement))
    assert "disk" in set(engine.model.hf_device_map.values())
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    engine.add_request("a", prompt_token_ids=PROMPTS[0], sampling_params=params)
    while engine.has_unfinished_requests():
        outputs = engine.step()
    assert outputs[0].outputs[0].token_ids == reference[0]


def test_bad_placement_flags_say_what_to_change(model_dir):
    assert parse_max_memory("0=20GiB, cpu=1000") == {0: "20GiB", "cpu": 1000}
    assert parse_device_map("balanced") == "balanced"
    with pytest.raises(InvalidRequest, match="JSON object"):
        parse_device_map("everywhere")
    with pytest.raises(InvalidRequest, match="DEVICE=SIZE"):
        parse_max_memory("20GiB")
    with pytest.raises(InvalidRequest, match="not a size"):
        parse_max_memory("cpu=lots")
    with pytest.raises(InvalidRequest, match="give --model"):
        Engine(engine_config(model=TINY_MODEL, device="cpu", device_map="auto"))
    with pytest.raises(InvalidRequest, match="not both"):
        Engine(engine_config(model=model_dir, device="cpu", cpu_offload_gb=1, max_memory="cpu=1GiB"))


def test_run_command_takes_the_placement_flags(model_dir, reference, tmp_path):
    from typer.testing import CliRunner

    from paged_backend.cli import app

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": byte_tokenizer().decode(p)}) + "\n" for p in PROMPTS))
    flags = ["--device", "cpu", "--dtype", DTYPE, "--num-blocks", "32", "--max-tokens", str(NEW_TOKENS), "--ignore-eos",
             "--no-progress"]  # fmt: skip
    args = ["run", "--model", model_dir, "--input", str(prompts), "--device-map", json.dumps(DISK_MAP), *flags]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [row["outputs"][0]["token_ids"] for row in rows] == reference


def test_pool_keeps_each_layer_on_its_own_device():
    from paged_backend.core.kv_cache import PagedKVCache

    cache = PagedKVCache(3, 2, 8, 6, 4, dtype=torch.float32, layer_devices=["cpu", "meta", "cpu"])
    assert [cache.layer(i)[0].device.type for i in range(3)] == ["cpu", "meta", "cpu"]
    assert len(cache.kvs) == 2 and cache.kv is None  # one tensor per device, layers 0 and 2 together
    assert cache.total_bytes == 6 * cache.bytes_per_block
    cache.layer(2)[1][1].fill_(7.0)
    cache.copy_blocks([(1, 3)])  # every device's tensor copies
    assert bool((cache.layer(2)[1][3] == 7.0).all()) and not bool(cache.layer(0)[1][3].any())


def test_serve_and_launch_map_the_placement_flags_onto_the_engine_config():
    from paged_backend.engine.args import EngineArgs
    from paged_backend.tgi.launcher.flags import parse_flags
    from paged_backend.tgi.launcher.launch import engine_config as launch_config

    flags = ["--device-map", json.dumps(DISK_MAP), "--max-memory", "cpu=1GiB", "--offload-folder", "/tmp/off"]
    config = launch_config(parse_flags(flags))
    assert (config.device_map, config.max_memory, config.offload_folder) == (DISK_MAP, {"cpu": "1GiB"}, "/tmp/off")
    config = EngineArgs(device_map="sequential", cpu_offload_gb=2.5).to_engine_config()
    assert (config.device_map, config.cpu_offload_gb) == ("sequential", 2.5)
