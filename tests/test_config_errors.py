"""Engine flags and environment switches a user gets wrong: each is one line naming the flag or variable, exit 2,
never a traceback; and the forms vLLM accepts are accepted."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from paged_backend.cli import app
from paged_backend.config import EngineConfig
from paged_backend.config.env import env_flag
from paged_backend.engine.args import EngineArgs
from paged_backend.errors import InvalidRequest, one_line
from paged_backend.lora.request import parse_lora_modules
from paged_backend.worker.default_model import TINY_MODEL
from paged_backend.worker.models import resolve_dtype

runner = CliRunner()


def run_error(tmp_path, *flags: str, env: dict[str, str] | None = None) -> str:
    """The one stderr line of `paged-backend run` on the tiny model with `flags`, which must exit 2."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello\n")
    args = ["run", "--model", TINY_MODEL, "-i", str(prompts), "--max-tokens", "2", "--no-progress", *flags]
    result = runner.invoke(app, args, env=env)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if not line.startswith("paged-backend: --dtype auto")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--block-size", "3"], "error: --block-size: block_size must be a power of two between 1 and 256"),
        (["--seed", str(2**64)], "error: --seed: Input should be less than 18446744073709551616"),
        (["--device", "mps"], "device must be auto, cpu, cuda or cuda:N, got 'mps'"),
        (["--speculative-config", "[1]"], "error: --speculative-config: speculative_config must be a JSON object"),
        (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 100}'],
         "error: --speculative-config: num_speculative_tokens: Input should be less than or equal to 16, got 100"),
        (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}'],
         "error: --speculative-config: bogus: Extra inputs are not permitted"),
        (["--max-model-len", "4096"], "max_model_len=4096 is longer than the model's context (2048 positions"),
        (["--lora-modules", "a=/x", "a=/y"], "--lora-modules names 'a' twice (/x and /y)"),
        (["--dtype", "double"], "dtype must be auto, float32, float16, bfloat16 (or half, float); got 'double'"),
    ],
)  # fmt: skip
def test_a_bad_engine_flag_is_one_line_naming_it(tmp_path, flags, said):
    assert said in run_error(tmp_path, *flags)


@pytest.mark.parametrize(
    ("variable", "value", "said"),
    [
        ("PAGED_BACKEND_BATCH_INVARIANT", "true-ish", "PAGED_BACKEND_BATCH_INVARIANT='true-ish' is not a boolean"),
        ("PAGED_BACKEND_FUSED_FORWARD", "maybe", "PAGED_BACKEND_FUSED_FORWARD='maybe' is not a boolean"),
        ("PAGED_BACKEND_NATIVE_LAYERS", "2", "PAGED_BACKEND_NATIVE_LAYERS='2' is not a boolean"),
        ("PAGED_BACKEND_ATTENTION", "flash", "PAGED_BACKEND_ATTENTION='flash' is not one of auto, torch, cpu"),
        ("PAGED_BACKEND_ATTENTION", "cuda", "PAGED_BACKEND_ATTENTION=cuda: attention backend"),
        ("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "sure", "VLLM_ALLOW_LONG_MAX_MODEL_LEN='sure' is not a boolean"),
    ],
)  # fmt: skip
def test_a_bad_environment_switch_is_one_line_naming_it(tmp_path, variable, value, said):
    flags = ["--max-model-len", "4096"] if variable == "VLLM_ALLOW_LONG_MAX_MODEL_LEN" else []
    assert said in run_error(tmp_path, *flags, env={variable: value})


def test_boolean_switches_read_every_usual_spelling(monkeypatch):
    for value, meant in [("1", True), ("TRUE", True), ("yes", True), ("on", True), ("0", False), ("off", False),
                         ("False", False), ("", True)]:  # fmt: skip
        monkeypatch.setenv("PAGED_BACKEND_TEST_SWITCH", value)
        assert env_flag("PAGED_BACKEND_TEST_SWITCH", True) is meant
    monkeypatch.setenv("PAGED_BACKEND_BATCH_INVARIANT", "true")  # "true" used to count as off: only "1" did
    assert EngineConfig().batch_invariant


def test_vllm_switch_allows_a_max_model_len_past_the_model_positions(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello\n")
    args = ["run", "--model", TINY_MODEL, "-i", str(prompts), "--max-tokens", "2", "--no-progress",
            "--max-model-len", "4096", "--num-blocks", "600"]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output


def test_vllm_dtype_names_half_and_float():
    import torch

    assert resolve_dtype("half", torch.device("cpu")) is torch.float16
    assert resolve_dtype("float", torch.device("cpu")) is torch.float32


def test_speculative_config_null_is_none_and_a_missing_method_names_the_flag():
    assert EngineArgs(speculative_config="null").to_engine_config().speculative_config is None
    with pytest.raises(Exception) as raised:
        EngineConfig(speculative_config='{"num_speculative_tokens": 2}')
    assert one_line(raised.value).startswith('--speculative-config: speculative_config needs "method"')


def test_lora_modules_refuse_one_name_for_two_adapters_and_non_string_fields():
    with pytest.raises(InvalidRequest, match="names 'a' twice"):
        parse_lora_modules(['{"name": "a", "path": "/x"}', "a=/y"])
    assert parse_lora_modules(['{"name": "a", "path": "/x"}', "a=/x"]) == {"a": "/x"}  # the same one twice
    with pytest.raises(InvalidRequest, match="must be non-empty strings"):
        parse_lora_modules(['{"name": 3, "path": "/x"}'])


def test_a_config_file_that_does_not_parse_is_one_line_with_where(tmp_path):
    bad = tmp_path / "engine.yaml"
    bad.write_text("max-num-seqs: [1\nblock-size: : 8\n")
    result = runner.invoke(app, ["run", "--model", TINY_MODEL, "-i", str(bad), "--config", str(bad)])
    assert result.exit_code == 2
    assert "not valid YAML: expected ',' or ']', but got ':' (line 2, column 11)" in result.stderr
    assert "^" not in result.stderr  # pyyaml's caret line stays out


def test_a_device_map_on_the_built_in_model_says_why(tmp_path):
    said = run_error(tmp_path, "--device-map", "auto")
    assert f"{TINY_MODEL} is built in memory: give --model a directory, hub id or .gguf file" in said


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"logprobs": True}, "logprobs must be an integer or None, got True"),  # reached torch.topk mid-step
        ({"max_tokens": 2.5}, "max_tokens must be an integer, got 2.5"),  # ran 3 tokens
        ({"n": "2"}, "n must be an integer, got '2'"),
        ({"temperature": None}, "temperature must be a number, got None"),
        ({"ignore_eos": "no"}, "ignore_eos must be True or False, got 'no'"),  # counted as True
        ({"seed": "abc"}, "seed must be an integer or None, got 'abc'"),
        ({"stop": 5}, "stop must be a string or a list of strings, got 5"),
        ({"stop_token_ids": [True]}, "stop_token_ids must be a list of token ids"),
        ({"logit_bias": [1, 2]}, "logit_bias must be a dict of token id to bias"),
        ({"structured_outputs": "json"}, "structured_outputs must be StructuredOutputsParams"),
    ],
)
def test_sampling_params_of_the_wrong_type_are_named(fields, said):
    from paged_backend.engine.sampling_params import SamplingParams

    with pytest.raises(InvalidRequest, match=re.escape(said)):
        SamplingParams(**fields)


def test_run_refuses_a_folder_as_output_before_running(tmp_path):
    said = run_error(tmp_path, "-o", str(tmp_path))  # it crashed after the whole run, losing the results
    assert said == f"error: --output {tmp_path} is a folder; name a file in it, e.g. {tmp_path / 'results.jsonl'}"


def test_generate_from_several_threads_takes_turns():
    """Two generate() calls stepping one engine at once tore its block tables (KeyError in the block manager)."""
    import threading

    from paged_backend.engine.llm import LLM
    from paged_backend.engine.sampling_params import SamplingParams

    llm = LLM(TINY_MODEL, device="cpu", dtype="float32", num_blocks=64)
    greedy = SamplingParams(max_tokens=6, temperature=0)
    want = [output.outputs[0].token_ids for output in llm.generate(["Hello", "World"], greedy)]
    results, errors = [], []

    def generate():
        try:
            results.append([output.outputs[0].token_ids for output in llm.generate(["Hello", "World"], greedy)])
        except Exception as error:  # noqa: BLE001 - the test reports any
            errors.append(repr(error))

    threads = [threading.Thread(target=generate) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert errors == [] and results == [want] * 4
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks - 1  # the null block


def test_llm_options_take_the_flags_names_as_vllms_llm_does():
    from paged_backend.engine.llm import engine_config

    config = engine_config(kv_cache_dtype="fp8", scheduling_policy="priority", max_model_len=64)
    assert (config.cache.cache_dtype, config.scheduler.policy, config.scheduler.max_model_len) == ("fp8", "priority", 64)
    with pytest.raises(InvalidRequest, match="unknown engine option"):
        engine_config(kv_cache_dtypes="fp8")


def test_chat_content_parts_are_read_as_their_text_as_vllm_reads_them():
    from paged_backend.engine.llm import LLM
    from paged_backend.engine.sampling_params import SamplingParams

    llm = LLM(TINY_MODEL, device="cpu", dtype="float32", num_blocks=64)
    greedy = SamplingParams(max_tokens=4, temperature=0)
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]
    plain = [{"role": "user", "content": "hi\nthere"}]  # the template printed the parts' Python repr
    assert llm.chat(parts, greedy)[0].prompt_token_ids == llm.chat(plain, greedy)[0].prompt_token_ids
    with pytest.raises(InvalidRequest, match="content part must be"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], greedy)
