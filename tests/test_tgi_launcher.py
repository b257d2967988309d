"""Launcher flags (names, env vars, defaults, ignored flags), the shard CLI and the generate.v3 stubs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import typer
from pydantic import ValidationError
from typer.testing import CliRunner

from paged_backend.errors import one_line
from paged_backend.tgi.launcher.cli import register
from paged_backend.tgi.launcher.flags import TGI_FLAG_OF_FIELD, ignored_flags, parse_flags
from paged_backend.tgi.launcher.launch import LaunchError, cuda_graph_max, engine_config, router_settings
from paged_backend.tgi.proto import generate_pb2 as pb
from paged_backend.tgi.proto.stubs import compile_stubs, proto_path
from paged_backend.tgi.shard.cli import app as shard_app


def test_tgi_defaults():
    args = parse_flags([])
    assert (args.backend, args.port, args.hostname, args.max_concurrent_requests) == ("paged", 3000, "0.0.0.0", 128)
    assert (args.max_best_of, args.max_stop_sequences, args.max_top_n_tokens) == (2, 4, 5)
    assert (args.max_batch_prefill_tokens, args.max_waiting_tokens, args.waiting_served_ratio) == (4096, 20, 0.3)
    assert ignored_flags(args) == []


def test_env_vars_follow_tgi_names_and_flags_win(monkeypatch):
    monkeypatch.setenv("MODEL_ID", "/models/x")
    monkeypatch.setenv("PORT", "8080")
    monkeypatch.setenv("TGI_BACKEND", "reference")
    monkeypatch.setenv("MAX_INPUT_TOKENS", "100")
    monkeypatch.setenv("TRUST_REMOTE_CODE", "true")
    args = parse_flags(["--port", "9090"])
    assert (args.model_id, args.port, args.backend, args.max_input_tokens) == ("/models/x", 9090, "reference", 100)
    assert args.trust_remote_code is True


def test_flags_without_meaning_are_reported_never_silent():
    args = parse_flags(["--speculate", "2", "--num-shard", "2", "--waiting-served-ratio", "1.2", "--sharded", "true"])
    assert ignored_flags(args) == ["--waiting-served-ratio"]
    assert ignored_flags(parse_flags(["--backend", "grpc", "--waiting-served-ratio", "1.2"])) == []
    assert ignored_flags(parse_flags(["--backend", "grpc", "--speculate", "2"])) == ["--speculate"]


def test_speculate_maps_to_ngram_speculation_as_tgi_does():
    config = engine_config(parse_flags(["--speculate", "2"])).speculative_config
    assert (config.method, config.num_speculative_tokens) == ("ngram", 2)
    sharded = engine_config(parse_flags(["--speculate", "2", "--num-shard", "2"]))  # on every shard layout
    assert (sharded.speculative_config.method, sharded.parallel.tensor_parallel_size) == ("ngram", 2)


def test_cuda_graphs_list_sets_the_largest_capture_size_on_a_gpu_only():
    assert [cuda_graph_max(sizes) for sizes in (None, "1,2,4,8,32", "0", "16")] == [None, 32, 0, 16]
    with pytest.raises(LaunchError, match="--cuda-graphs takes batch sizes"):
        cuda_graph_max("1,two")
    with pytest.raises(LaunchError, match="--cuda-graphs takes batch sizes"):
        cuda_graph_max("-1")
    on_cpu = engine_config(parse_flags(["--cuda-graphs", "1,2,4,8", "--device", "cpu"]))
    assert on_cpu.max_cudagraph_capture_size == 0  # TGI's CPU backends capture nothing either
    assert ignored_flags(parse_flags(["--backend", "reference", "--cuda-graphs", "8"])) == ["--cuda-graphs"]


def test_legacy_max_input_length_and_startup_checks():
    args = parse_flags(["--max-input-length", "300", "--max-total-tokens", "300"])
    assert args.max_input_tokens == 300
    with pytest.raises(LaunchError, match="`max_input_tokens` must be < `max_total_tokens`"):
        router_settings(args, max_model_len=1024)
    settings = router_settings(parse_flags(["--max-total-tokens", "512"]), max_model_len=1024)
    assert (settings.max_input_tokens, settings.max_total_tokens) == (511, 512)


def test_engine_config_from_tgi_flags():
    args = parse_flags(
        [
            "--max-batch-total-tokens",
            "1000",
            "--max-batch-size",
            "8",
            "--max-batch-prefill-tokens",
            "512",
            "--kv-cache-dtype",
            "fp8_e4m3fn",
            "--cuda-memory-fraction",
            "0.5",
            "--max-total-tokens",
            "256",
        ]
    )
    config = engine_config(args)
    assert config.cache.num_blocks == 63 + 1 and config.cache.cache_dtype == "fp8"
    assert config.cache.gpu_memory_utilization == 0.5
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (8, 512)
    assert config.scheduler.max_model_len == 256 and config.model is None


def test_launch_help_lists_tgi_flags():
    result = subprocess.run(
        [sys.executable, "-m", "paged_backend.tgi", "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0
    for flag in ("--model-id", "--max-batch-prefill-tokens", "--backend", "--shard-uds-path", "--api-key"):
        assert flag in result.stdout


def test_register_adds_launch_to_a_typer_app():
    app = typer.Typer()

    @app.command()
    def other() -> None:
        """Another command, so typer keeps sub-command names."""

    register(app)
    result = CliRunner().invoke(app, ["launch", "--backend", "nope"])
    assert result.exit_code == 2 and "invalid choice: 'nope'" in result.output


def test_shard_cli_has_tgi_serve_flags_and_a_local_download():
    runner = CliRunner()
    help_text = runner.invoke(shard_app, ["serve", "--help"], terminal_width=200).output
    for flag in ("--uds-path", "--sharded", "--quantize", "--dtype", "--kv-cache-dtype", "--max-input-tokens"):
        assert flag in help_text
    assert runner.invoke(shard_app, ["download-weights", "paged-backend/embedded-tiny"]).exit_code == 0


def test_proto_keeps_tgi_field_numbers():
    fields = {
        "Request": {"id": 1, "inputs": 2, "truncate": 3, "blocks": 9, "slots": 10, "cache_len": 12, "chunk_len": 14},
        "CachedBatch": {"id": 1, "request_ids": 2, "size": 3, "max_tokens": 4, "current_tokens": 5},
        "InfoResponse": {"support_chunking": 6, "use_prefix_caching": 7, "attention_impl": 8, "block_size": 9},
        "WarmupResponse": {"max_supported_total_tokens": 1, "max_input_tokens": 2, "max_total_tokens": 3},
        "Generation": {"request_id": 1, "prefill_tokens": 2, "tokens": 3, "generated_text": 4, "top_tokens": 5},
    }
    assert pb.DESCRIPTOR.package == "generate.v3"
    for message, numbers in fields.items():
        descriptor = pb.DESCRIPTOR.message_types_by_name[message]
        assert {name: descriptor.fields_by_name[name].number for name in numbers} == numbers
    assert not pb.WarmupResponse().HasField("max_supported_total_tokens")
    assert pb.Request(chunk_len=0).HasField("chunk_len")
    service = pb.DESCRIPTOR.services_by_name["TextGenerationService"]
    assert {m.name for m in service.methods} == {
        "Info",
        "Health",
        "ServiceDiscovery",
        "ClearCache",
        "FilterBatch",
        "Warmup",
        "Prefill",
        "Decode",
    }


def test_stubs_compile_into_any_directory(tmp_path):
    compile_stubs(proto_path(), tmp_path)
    grpc_module = (tmp_path / "generate_pb2_grpc.py").read_text()
    assert "from . import generate_pb2" in grpc_module


@pytest.mark.parametrize(
    "flags, named",
    [(["--port", "70000"], "--port"), (["--max-best-of", "-1"], "--max-best-of"),
     (["--max-stop-sequences", "-3"], "--max-stop-sequences"), (["--payload-limit", "-1"], "--payload-limit"),
     (["--max-concurrent-requests", "0"], "--max-concurrent-requests"), (["--sharded", "maybe"], "--sharded"),
     (["--speculate", "-1"], "--speculate"), (["--max-input-tokens", "0"], "--max-input-tokens"),
     (["--max-batch-size", "0"], "--max-batch-size"), (["--num-blocks", "-1"], "--num-blocks"),
     (["--master-port", "70000"], "--master-port")],
)  # fmt: skip
def test_out_of_range_flags_are_refused_at_parse_time_as_tgi_s_launcher_types_them(flags, named, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_flags(flags)
    assert exit_.value.code == 2 and named in capsys.readouterr().err


def test_an_engine_value_refused_names_the_tgi_flag_that_set_it():
    with pytest.raises(ValidationError) as refused:
        engine_config(parse_flags(["--cuda-memory-fraction", "1.5"]))
    said = one_line(refused.value, TGI_FLAG_OF_FIELD)
    assert said.startswith("--cuda-memory-fraction: ") and "gpu-memory-utilization" not in said


def test_a_router_with_no_shard_says_so_and_exits_cleanly(tmp_path, monkeypatch, caplog):
    import grpc

    from paged_backend.tgi.router import backend

    monkeypatch.setattr(backend, "SHARD_WAIT_S", 1)
    master = f"{tmp_path}/shard-0"
    with grpc.insecure_channel(f"unix://{master}") as channel, pytest.raises(SystemExit) as exit_:
        backend.wait_for_shard(channel, master, started_here=False)
    assert f"no shard answered at {master} within 1 s" in str(exit_.value.code)
    assert f"no shard at {master} yet; waiting up to 1 s" in caplog.text


TGI_ENV_VARS = ("TGI_BACKEND", "PORT", "MAX_BATCH_SIZE", "SHARDED", "CUDA_MEMORY_FRACTION", "TRUST_REMOTE_CODE",
                "CUDA_GRAPHS", "MAX_INPUT_TOKENS", "MAX_TOTAL_TOKENS", "MODEL_ID", "NUM_SHARD")  # fmt: skip


def _launch(flags: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`paged-backend launch FLAGS` as a user runs it (the typer app), with `env` on a clean TGI environment."""
    environ = {key: value for key, value in os.environ.items() if key not in TGI_ENV_VARS}
    environ.update(HF_HUB_OFFLINE="1", **(env or {}))
    command = [sys.executable, "-c", "from paged_backend.cli import app; app()", "launch", *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=environ)


def _assert_usage_error(result: subprocess.CompletedProcess, *named: str) -> None:
    """Exit 2 and one line `paged-backend launch: error: ...` naming what to change; no traceback, no usage dump."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and len(lines) == 1, result.stderr
    assert lines[0].startswith("paged-backend launch: error: ") and lines[0].endswith("--help)"), lines[0]
    for name in named:
        assert name in lines[0], lines[0]


@pytest.mark.parametrize(
    "env, named",
    [({"TGI_BACKEND": "foo"}, ["TGI_BACKEND", "--backend", "'paged', 'reference', 'grpc'"]),
     ({"PORT": "x"}, ["PORT", "--port", "invalid int value"]),
     ({"MAX_BATCH_SIZE": "0"}, ["MAX_BATCH_SIZE", "--max-batch-size", "[1, inf]"]),
     ({"SHARDED": "maybe"}, ["SHARDED", "--sharded", "true or false"]),
     ({"CUDA_MEMORY_FRACTION": "abc"}, ["CUDA_MEMORY_FRACTION", "--cuda-memory-fraction", "invalid float value"]),
     ({"TRUST_REMOTE_CODE": "maybe"}, ["TRUST_REMOTE_CODE", "--trust-remote-code", "true"]),
     ({"CUDA_GRAPHS": "abc"}, ["CUDA_GRAPHS", "--cuda-graphs", "1,2,4,8"])],
)  # fmt: skip
def test_a_bad_env_value_is_refused_at_once_naming_the_env_var_and_its_flag(env, named):
    _assert_usage_error(_launch(["--device", "cpu"], env), *named)


def test_help_works_whatever_the_environment_holds():
    result = _launch(["--help"], {"PORT": "x", "TGI_BACKEND": "foo", "SHARDED": "maybe"})
    assert result.returncode == 0 and "--port" in result.stdout and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "flags, named",
    [(["--port", "x"], ["--port", "invalid int value: 'x'"]),
     (["--backend", "nope"], ["--backend", "invalid choice: 'nope'"]),
     (["--cuda-graphs", "abc"], ["--cuda-graphs", "1,2,4,8"]),
     (["--cuda-memory-fraction", "1.5"], ["--cuda-memory-fraction", "less than or equal to 1"]),  # the engine's check
     (["--speculate", "100"], ["--speculate: num_speculative_tokens: Input should be less than or equal to 16"]),
     (["--max-input-tokens", "600", "--max-total-tokens", "500"], ["--max-input-tokens", "--max-total-tokens"]),
     (["--sharded", "false", "--num-shard", "2"], ["--sharded", "--num-shard"])],
)  # fmt: skip
def test_usage_errors_exit_2_with_one_line_naming_the_flag(flags, named):
    _assert_usage_error(_launch(["--device", "cpu", *flags]), *named)


def test_env_values_are_checked_only_where_they_are_used(monkeypatch, tmp_path):
    monkeypatch.setenv("PORT", "x")
    monkeypatch.setenv("TGI_BACKEND", "foo")
    assert (parse_flags(["--port", "9090", "--backend", "grpc"]).port, "grpc") == (9090, "grpc")  # the flag wins
    config = tmp_path / "launch.yaml"
    config.write_text("port: 8080\nbackend: reference\n")
    assert parse_flags(["--config", str(config)]).port == 8080  # so does the config file
    monkeypatch.setenv("PORT", "")
    monkeypatch.setenv("TGI_BACKEND", " ")
    assert (parse_flags([]).port, parse_flags([]).backend) == (3000, "paged")  # an empty env var is unset, as clap's
    monkeypatch.setenv("TRUST_REMOTE_CODE", "0")
    monkeypatch.setenv("CUDA_GRAPHS", "1,2,8")
    args = parse_flags([])
    assert (args.trust_remote_code, args.cuda_graphs, cuda_graph_max(args.cuda_graphs)) == (False, "1,2,8", 8)


@pytest.mark.parametrize(
    "env, flags, named",
    [({"PORT": "70000"}, [], "env PORT='70000' (sets --port): must be in [0, 65535]"),
     ({"CUDA_GRAPHS": "1,-2"}, [], "env CUDA_GRAPHS='1,-2' (sets --cuda-graphs): must be batch sizes like 1,2,4,8"),
     ({}, ["--cuda-graphs", "1,-2"], "argument --cuda-graphs: must be batch sizes like 1,2,4,8"),
     ({}, ["--cuda-graphs", ""], "argument --cuda-graphs: must be batch sizes like 1,2,4,8")],
)  # fmt: skip
def test_env_and_flag_values_get_the_same_checks(env, flags, named, monkeypatch, capsys):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exit_:
        parse_flags(flags)
    said = capsys.readouterr().err
    assert exit_.value.code == 2 and named in said and len(said.strip().splitlines()) == 1, said
