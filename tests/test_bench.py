"""`paged-backend bench throughput` and `bench latency`, small: the CLI runs them, each prints its table and
writes JSON and a PNG; a JSONL workload is read as given."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from paged_backend.bench.chat_workload import chat_workload
from paged_backend.bench.workload import jsonl_workload
from paged_backend.cli import app
from paged_backend.errors import InvalidRequest
from paged_backend.worker.default_model import TINY_MODEL
from paged_backend.worker.models import byte_tokenizer
from tests._http_stub import answering

PNG = b"\x89PNG\r\n\x1a\n"


def test_throughput_quick_on_a_jsonl_workload(tmp_path):
    dataset = tmp_path / "workload.jsonl"
    dataset.write_text('{"prompt": "hello there", "max_tokens": 6}\n{"prompt": [5, 6, 7, 8], "max_tokens": 4}\n\n'
                       '{"prompt": "a", "output_len": 3}\n')  # fmt: skip
    json_path, png_path = tmp_path / "throughput.json", tmp_path / "throughput.png"
    result = CliRunner().invoke(app, ["bench", "throughput", "--quick", "--vocab-size", "256", "--dataset", str(dataset),
                                      "--static-batch-sizes", "3", "--skip", "hf-cb",
                                      "--output-json", str(json_path), "--plot", str(png_path)])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "| system | seconds | req/s | output tok/s |" in result.output
    written = json.loads(json_path.read_text())
    assert written["num_requests"] == 3 and written["output_tokens"] == 13
    # HF's continuous-batching manager takes 10-20 s to wind down even on three requests: skipped here.
    assert [r["system"] for r in written["results"]] == [
        "paged-backend engine mbt=512", "paged-backend engine mbt=512, dense weights", "HF generate static batch=3"
    ]
    assert set(written["speedup"]) == {"vs_best_hf_static"}
    assert png_path.read_bytes()[:8] == PNG


def test_throughput_on_chat_prompts_stops_at_eos_and_compares_tokens(tmp_path):
    """`--dataset chat`: prompts through the chat template, natural EOS with a cap, and every system's greedy
    tokens checked against the engine's (the tiny model here; the real model's numbers are in RESULTS.md)."""
    json_path = tmp_path / "chat.json"
    result = CliRunner().invoke(app, ["bench", "throughput", "--model", TINY_MODEL, "--dataset", "chat",
                                      "--num-requests", "2", "--max-tokens", "8", "--static-batch-sizes", "2",
                                      "--skip", "hf-cb,engine-dense", "--output-json", str(json_path), "--plot", ""])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "natural EOS (ids [254]), each capped" in result.output
    written = json.loads(json_path.read_text())
    assert written["natural_eos"] and written["num_requests"] == 2
    engine, static = written["results"]
    assert 2 <= engine["output_tokens"] == static["output_tokens"] <= 16
    assert static["token_mismatches"] == [] and "| HF generate static batch=2 |" in result.output


def test_chat_workload_refuses_more_requests_than_it_holds():
    with pytest.raises(InvalidRequest, match="holds 96 distinct prompts; give --num-requests between 1 and 96"):
        chat_workload(byte_tokenizer(), 97, seed=0, max_tokens=8)


def test_latency_quick(tmp_path):
    json_path, png_path = tmp_path / "latency.json", tmp_path / "latency.png"
    result = CliRunner().invoke(app, ["bench", "latency", "--quick", "--vocab-size", "256", "--input-len", "8",
                                      "--output-len", "4", "--num-iters", "2", "--output-json", str(json_path),
                                      "--plot", str(png_path)])  # fmt: skip
    assert result.exit_code == 0, result.output
    written = json.loads(json_path.read_text())
    assert set(written["results"]) == {"paged-backend engine", "HF generate"}
    assert all(len(r["iterations_s"]) == 2 and r["p99"] > 0 for r in written["results"].values())
    assert png_path.read_bytes()[:8] == PNG


def test_latency_times_hf_generate_in_the_engines_dtype(tmp_path):
    json_path = tmp_path / "latency.json"
    result = CliRunner().invoke(app, ["bench", "latency", "--quick", "--vocab-size", "256", "--input-len", "8",
                                      "--output-len", "2", "--num-iters", "1", "--skip", "engine", "--dtype", "bfloat16",
                                      "--output-json", str(json_path), "--plot", ""])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads(json_path.read_text())["model"].endswith("bfloat16")


def test_jsonl_workload_names_the_bad_line(tmp_path):
    dataset = tmp_path / "bad.jsonl"
    dataset.write_text('{"prompt": "ok", "max_tokens": 2}\n{"prompt": "no budget"}\n')
    with pytest.raises(
        InvalidRequest, match=r"bad.jsonl:2: needs a non-empty \"prompt\" and a positive \"max_tokens\""
    ):
        jsonl_workload(dataset, byte_tokenizer())


def _one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    error = result.output.strip().splitlines()[-1]  # (after the startup lines, e.g. the dtype chosen)
    assert "Traceback" not in result.output and error.startswith("error: "), result.output
    return error


@pytest.mark.parametrize(
    ("lines", "said"),
    [
        (None, "cannot be read as a JSONL file"),
        ('{"prompt": "a", "max_tokens": 2}\nnot json\n', "data.jsonl:2: not JSON"),
        ("[1, 2]\n", "data.jsonl:1: needs a non-empty"),
        ("\n", "no requests"),
    ],
)
def test_bench_dataset_errors_are_one_line(tmp_path, lines, said):
    dataset = tmp_path / "data.jsonl"
    if lines is not None:
        dataset.write_text(lines)
    result = CliRunner().invoke(app, ["bench", "throughput", "--quick", "--dataset", str(dataset)])
    assert said in _one_line_error(result)


def test_bench_on_a_model_that_does_not_exist_is_one_line(tmp_path):
    result = CliRunner().invoke(app, ["bench", "latency", "--model", str(tmp_path / "missing")])
    assert "not found" in _one_line_error(result)


def test_bench_serve_where_no_server_answers_is_one_line():
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = CliRunner().invoke(app, ["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "1"])
    assert f"no server answered at http://127.0.0.1:{port}/v1/models" in _one_line_error(result)


def test_bench_serve_against_a_server_without_models_is_one_line():
    with answering(501) as url:
        result = CliRunner().invoke(app, ["bench", "serve", "--base-url", url, "--num-prompts", "1"])
    assert f"{url}/v1/models answered HTTP 501 without a model" in _one_line_error(result)
    assert "give --model" in result.output


def test_bench_serve_rejects_an_unknown_slo():
    from paged_backend.bench.serve import parse_goodput

    assert parse_goodput(["ttft:200", "tpot:50"]) == {"ttft": 0.2, "tpot": 0.05}
    with pytest.raises(SystemExit, match="--goodput takes KEY:MILLISECONDS"):
        parse_goodput(["latency:5"])


@pytest.mark.parametrize(
    ("command", "said"),
    [
        (["throughput", "--quick", "--num-requests", "-5"], "--num-requests: must be a whole number of at least 1"),
        (["throughput", "--quick", "--threads", "1,0"], "--threads: must be a whole number of at least 1, got '0'"),
        (["throughput", "--quick", "--output-json", "/no/such/folder/x.json"], "the folder of '/no/such/folder"),
        (["latency", "--quick", "--batch-size", "0"], "--batch-size: must be a whole number of at least 1"),
        # the synthetic model's byte tokenizer needs 256 ids (it failed in torch: padding_idx outside the embedding)
        (["throughput", "--quick", "--vocab-size", "1"], "--vocab-size: must be a whole number of at least 256, got '1'"),
        (["latency", "--quick", "--vocab-size", "255"], "--vocab-size: must be a whole number of at least 256"),
        (["quantization", "--vocab-size", "0"], "bench quantization: error: argument --vocab-size: must be a whole"),
    ],
)
def test_bench_flags_out_of_range_are_usage_errors_before_the_run(command, said):
    result = CliRunner().invoke(app, ["bench", *command])
    assert result.exit_code == 2 and said in result.output and "Traceback" not in result.output, result.output
