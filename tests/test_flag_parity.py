"""Engine flags from one declaration (paged_backend.engine.args): every engine option is on `run`, `serve`,
`bench throughput`, `bench latency` and `launch`; `--help` never cuts a flag name; and vLLM's command-line forms
work: lists as several values, `--x/--no-x`, `--flag=value`, `--config FILE` and the positional MODEL.

`launch` keeps text-generation-launcher's names where TGI has the option (`--model-id` for `--model`, ...):
its ENGINE_FLAG_ALIASES is the documented list, and the check below expects those names there."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from _lora_helpers import DTYPE, PROMPTS, expected_tokens, save_base_and_adapters
from _server_helpers import running_server
from typer.testing import CliRunner

from paged_backend.bench import latency, throughput
from paged_backend.cli import app
from paged_backend.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from paged_backend.engine.args import ENGINE_FLAGS, EngineArgs, parse_with_config
from paged_backend.tgi.launcher.flags import ENGINE_FLAG_ALIASES, TGI_NAMES, ignored_flags, parse_flags
from paged_backend.tgi.launcher.launch import LaunchError, engine_config
from paged_backend.worker.default_model import TINY_MODEL
from paged_backend.worker.models import byte_tokenizer, tiny_model

BOOLEANS = [flag for flag in ENGINE_FLAGS if flag.kind is bool]
FACES = {  # a command line that starts an engine -> {engine field: the flag it goes by there}
    "run": {flag.field: flag.name for flag in ENGINE_FLAGS},
    "serve": {flag.field: flag.name for flag in ENGINE_FLAGS},
    "bench throughput": {flag.field: flag.name for flag in ENGINE_FLAGS},
    "bench latency": {flag.field: flag.name for flag in ENGINE_FLAGS},
    "launch": {flag.field: ENGINE_FLAG_ALIASES.get(flag.field, flag.name) for flag in ENGINE_FLAGS},
}
JSON_ADAPTER = '{"name": "c", "path": "/z", "base_model_name": "m"}'


def has_flag(text: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


def help_text(command: str, columns: int = 40) -> str:
    result = CliRunner().invoke(app, [*command.split(), "--help"], env={"COLUMNS": str(columns)})
    assert result.exit_code == 0, result.output
    return result.output


def test_each_engine_option_is_one_engine_config_field():
    nested = [CacheConfig, SchedulerConfig, ParallelConfig]
    fields = set(EngineConfig.model_fields) - {"cache", "scheduler", "parallel"}
    fields |= {name for group in nested for name in group.model_fields}
    assert set(EngineArgs.model_fields) == fields
    assert EngineArgs().to_engine_config() == EngineConfig()


@pytest.mark.parametrize("command", FACES)
def test_every_engine_flag_is_in_the_help_of_every_face_uncut(command):
    text = help_text(command)
    missing = [flag for flag in FACES[command].values() if not has_flag(text, flag)]
    tgi_switches = set(ENGINE_FLAG_ALIASES) | {flag.field for flag in ENGINE_FLAGS if flag.name in TGI_NAMES}
    negated = [flag for flag in BOOLEANS if command != "launch" or flag.field not in tgi_switches]  # TGI's own form
    missing += [f"--no-{flag.name[2:]}" for flag in negated if not has_flag(text, f"--no-{flag.name[2:]}")]
    assert missing == [] and "…" not in text


@pytest.mark.parametrize("command", ["", "version", "kv-map", "dashboards", "dashboards render", "bench", "bench serve"])
def test_no_help_cuts_a_flag_name(command):
    assert "…" not in help_text(command)


def test_serve_help_piped_to_grep_at_40_columns_finds_the_flag():
    executable = Path(sys.executable).with_name("paged-backend")
    env = {**os.environ, "COLUMNS": "40"}
    for flag in ("--max-concurrency", "--max-concurrent-requests", "--disable-hybrid-kv-cache-manager"):
        found = subprocess.run(f"{executable} serve --help | grep -- {flag}", shell=True, env=env, timeout=300,
                               capture_output=True, text=True)  # fmt: skip
        assert found.returncode == 0, (flag, found.stderr)


def parsed(command: str, *args: str) -> dict:
    """What the real `run` / `serve` command parses from `args` (its click context's parameters)."""
    return typer.main.get_command(app).commands[command].make_context(command, list(args)).params


@pytest.mark.parametrize("command", ["run", "serve"])
def test_list_flags_take_several_values_the_repeated_form_and_json(command):
    spaced = parsed(command, "--lora-modules", "a=/x", "b=/y", "--max-num-seqs", "4")
    repeated = parsed(command, "--lora-modules", "a=/x", "--lora-modules", "b=/y", "--max-num-seqs", "4")
    assert spaced["lora_modules"] == repeated["lora_modules"] == ["a=/x", "b=/y"] and spaced["max_num_seqs"] == 4
    mixed = parsed(command, "--lora-modules", "a=/x", JSON_ADAPTER, "--lora-modules=d=/w")["lora_modules"]
    assert EngineArgs(lora_modules=mixed).to_engine_config().lora_modules == {"a": "/x", "c": "/z", "d": "/w"}


def test_serve_takes_several_models_and_served_names_after_one_flag():
    params = parsed("serve", "--model", "/m1", "/m2", "--served-model-name", "a", "b", "--port", "9")
    assert (list(params["model"]), params["served_model_name"], params["port"]) == (["/m1", "/m2"], ["a", "b"], 9)


@pytest.mark.parametrize("command", ["run", "serve"])
def test_booleans_take_both_forms_and_flag_equals_value(command):
    params = parsed(command, "--no-enable-prefix-caching", "--enforce-eager", "--no-enable-lora", "--block-size=8",
                    "--kv-cache-dtype=fp8", "-tp", "2", "MODEL")  # fmt: skip
    assert (params["enable_prefix_caching"], params["enforce_eager"], params["enable_lora"]) == (False, True, False)
    assert (params["block_size"], params["cache_dtype"], params["tensor_parallel_size"]) == (8, "fp8", 2)
    assert params["model_tag"] == "MODEL" and parsed(command)["calculate_kv_scales"] is None  # not given: None


def write_config(tmp_path: Path, text: str, name: str = "engine.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


CONFIG = """max_num_seqs: 4
block-size: 8
enable_prefix_caching: false
lora-modules: [a=/x, {name: b, path: /y}]
speculative-config: {method: ngram, num_speculative_tokens: 2}
"""


@pytest.mark.parametrize("command", ["run", "serve"])
def test_config_file_keys_are_flag_names_and_the_command_line_wins(command, tmp_path):
    path = write_config(tmp_path, CONFIG)
    params = parsed(command, "--config", path, "--max-num-seqs", "5", "--lora-modules", "c=/z")
    assert (params["max_num_seqs"], params["block_size"], params["enable_prefix_caching"]) == (5, 8, False)
    assert params["lora_modules"] == ["c=/z"]  # the command line's list replaces the file's
    assert json.loads(params["speculative_config"]) == {"method": "ngram", "num_speculative_tokens": 2}
    from_file = parsed(command, f"--config={path}")["lora_modules"]
    assert EngineArgs(lora_modules=from_file).to_engine_config().lora_modules == {"a": "/x", "b": "/y"}
    toml = write_config(tmp_path, 'max-num-seqs = 3\nkv_cache_dtype = "fp8"\n', "engine.toml")
    assert (parsed(command, "--config", toml)["max_num_seqs"], parsed(command, "--config", toml)["cache_dtype"]) == (
        3, "fp8"
    )  # fmt: skip
    bad = CliRunner().invoke(app, [command, "--config", write_config(tmp_path, "max_num_seq: 4\n")])
    assert bad.exit_code == 2 and "max-num-seq" in bad.output


@pytest.mark.parametrize("bench", [throughput, latency])
def test_bench_parsers_take_the_same_forms(bench, tmp_path):
    path = write_config(tmp_path, CONFIG)
    flags = ["--config", path, "--lora-modules", "c=/z", JSON_ADAPTER, "--lora-modules", "d=/w", "--max-num-seqs=5",
             "--enforce-eager"]  # fmt: skip
    args = parse_with_config(bench.build_parser(), flags)
    engine = EngineArgs.from_namespace(args)
    assert (engine.max_num_seqs, engine.block_size, engine.enable_prefix_caching, engine.enforce_eager) == (
        5, 8, False, True
    )  # fmt: skip
    assert engine.to_engine_config().lora_modules == {"c": "/z", "d": "/w"}
    assert parse_with_config(bench.build_parser(), ["--no-enforce-eager"]).enforce_eager is False


def test_bench_keeps_its_own_meaning_for_its_own_flags_and_passes_the_rest_to_the_engine():
    args = parse_with_config(throughput.build_parser(), ["--seed", "3", "--tensor-parallel-size", "2",
                                                         "--swap-space", "1", "--no-prepack-weights"])  # fmt: skip
    assert throughput.engine_kwargs(args) == {
        "swap_space": 1.0,
        "prepack_weights": False,
        "max_num_batched_tokens": 512,
    }


def test_launch_takes_tgi_names_and_adds_the_engine_options_tgi_lacks(tmp_path, monkeypatch):
    monkeypatch.setenv("MAX_BATCH_SIZE", "16")  # TGI's env vars still work, below the config file
    path = write_config(tmp_path, "max-batch-size: 8\nmax_loras: 2\nenable-chunked-prefill: false\n")
    args = parse_flags(["--config", path, "--max-total-tokens=256", "--seed=3", "--no-enable-prefix-caching",
                        "--swap-space", "1", "--pipeline-parallel-size", "1", "--max-loras", "3"])  # fmt: skip
    config = engine_config(args)
    assert (config.scheduler.max_num_seqs, config.scheduler.max_model_len, config.seed, config.max_loras) == (
        8,
        256,
        3,
        3,
    )
    assert (config.cache.enable_prefix_caching, config.scheduler.enable_chunked_prefill) == (False, False)
    assert config.cache.swap_space == 1.0 and ignored_flags(args) == []
    monkeypatch.delenv("MAX_BATCH_SIZE")
    reference = parse_flags(["--backend", "reference", "--seed", "3", "--enforce-eager"])
    assert ignored_flags(reference) == ["--seed", "--enforce-eager"]  # the engine's options, unused by HF generate


def test_launch_speculative_config_or_tgi_speculate_not_both():
    config = engine_config(parse_flags(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}']))
    assert config.speculative_config.num_speculative_tokens == 4
    with pytest.raises(LaunchError, match="not both"):
        engine_config(parse_flags(["--speculate", "2", "--speculative-config", '{"method": "ngram"}']))


def test_run_takes_the_model_positionally_as_vllm_does(tmp_path):
    model_dir = tmp_path / "model"
    tiny_model("llama", seed=5).save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello there\n")
    common = ["-i", str(prompts), "--max-tokens", "4", "--ignore-eos", "--no-progress", "--num-blocks", "32"]
    outputs = []
    for args in (["run", str(model_dir), *common], ["run", "--model", str(model_dir), *common],
                 ["run", "--model", TINY_MODEL, *common]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
        outputs.append(rows[0]["outputs"][0]["token_ids"])
    assert outputs[0] == outputs[1] != outputs[2]  # the positional MODEL is --model, not another model


MAX_TOKENS = 6


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    """A real `serve MODEL --enable-lora --lora-modules a=DIR b=DIR` (vLLM's form: two adapters after one flag)."""
    model_dir, saved = save_base_and_adapters("llama", tmp_path_factory.mktemp("parity"))
    adapters = {"a": saved["attn4"], "b": saved["all8"]}
    flags = [str(model_dir), "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--num-blocks", "64",
             "--dtype", DTYPE,  # as peft's reference (--dtype auto may be bfloat16)
             "--lora-modules", f"a={adapters['a']}", f"b={adapters['b']}"]  # fmt: skip
    with running_server(*flags) as server:
        yield server, str(model_dir), expected_tokens("llama", adapters, MAX_TOKENS)


def test_serve_model_positional_serves_both_adapters_of_one_lora_flag(lora_server):
    server, model_dir, expected = lora_server
    assert len({tuple(tokens[0]) for tokens in expected.values()}) == 3  # each adapter really changes the tokens
    client = server.client()
    cards = {card.id: getattr(card, "parent", None) for card in client.models.list().data}
    assert cards == {model_dir: None, "a": model_dir, "b": model_dir}
    for name in (model_dir, "a", "b"):
        for index, prompt in enumerate(PROMPTS):
            completion = client.completions.create(
                model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
                extra_body={"return_tokens_as_token_ids": True},
            )  # fmt: skip
            tokens = [int(t.removeprefix("token_id:")) for t in completion.choices[0].logprobs.tokens]
            assert tokens == expected[None if name == model_dir else name][index], (name, index)
