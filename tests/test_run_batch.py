"""`paged-backend run-batch -i requests.jsonl -o results.jsonl`, the real command: its output equals the online
answers of a real server line by line (chat, completions, responses), and malformed lines become error lines;
the summary counts the lines and the tokens their answers report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from paged_backend.server.batch_lines import line_usage
from tests._server_helpers import MODEL, running_server
from tests.test_batches_api import EXACT, chat_line, comparable, completion_line, jsonl, online_answer


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(*EXACT, "--files-dir", str(tmp_path_factory.mktemp("files"))) as running:
        yield running


def responses_line(custom_id: str, text: str, max_output_tokens: int = 8) -> dict:
    body = {"model": MODEL, "input": text, "max_output_tokens": max_output_tokens, "temperature": 0, "store": False}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/responses", "body": body}


def comparable_response(body: dict) -> dict:
    """A /v1/responses answer without its ids and creation time (the output items carry ids of their own)."""
    output = [{key: value for key, value in item.items() if key != "id"} for item in body.get("output", [])]
    return {**comparable(body), "output": output}


LINES = [
    chat_line("chat-0", "What does a paged cache do?"),
    completion_line("text-0", "The scheduler picks", max_tokens=10),
    responses_line("resp-0", "Say something about blocks."),
    chat_line("chat-1", "And continuous batching?", max_tokens=12),
    completion_line("text-1", "Prefix caching means", max_tokens=5),
    responses_line("resp-1", "One more, please.", max_output_tokens=6),
    chat_line("too-long", "x", max_tokens=100_000),  # the route's own 400
    "{broken",
    {**chat_line("wrong-url", "x"), "url": "/v1/embeddings"},
]


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> tuple[list[dict], str]:
    directory = tmp_path_factory.mktemp("run_batch")
    requests, results = directory / "requests.jsonl", directory / "results.jsonl"
    requests.write_bytes(jsonl(LINES))
    command = [str(Path(sys.executable).with_name("paged-backend")), "run-batch", "-i", str(requests),
               "-o", str(results), "--model", MODEL, "--device", "cpu", *EXACT]  # fmt: skip
    finished = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr
    return [json.loads(line) for line in results.read_text().splitlines()], finished.stderr


def test_output_lines_equal_the_online_answers(server, outputs):
    lines, _ = outputs
    sent = [line for line in LINES if isinstance(line, dict) and line["url"] != "/v1/embeddings"]
    answered = {output["custom_id"]: output for output in lines}
    for line in sent:
        status, online = online_answer(server, line)
        response = answered[line["custom_id"]]["response"]
        assert response["status_code"] == status
        if line["url"] == "/v1/responses":
            assert status == 200 and online["object"] == "response"
            assert response["body"]["output"] and comparable_response(response["body"]) == comparable_response(online)
        elif status == 200:
            assert comparable(response["body"]) == comparable(online)
        else:
            assert response["body"] == online  # the same 400, message and all


def test_output_keeps_the_input_order_with_error_lines_for_malformed_lines(outputs):
    lines, stderr = outputs
    assert [output["custom_id"] for output in lines] == [line["custom_id"] if isinstance(line, dict) else None
                                                         for line in LINES]  # fmt: skip
    broken, wrong_url = lines[-2:]
    assert broken["response"] is None and "line 8 is not valid JSON" in broken["error"]["message"]
    assert wrong_url["response"] is None and "unknown url '/v1/embeddings'" in wrong_url["error"]["message"]
    assert all(output["id"].startswith("batch_req_") for output in lines)
    assert "run-batch" in stderr and "9 lines" in stderr and "6 answered, 3 failed" in stderr
    usages = [line_usage(output) for output in lines]
    inputs, cached, outs = (sum(usage[key] for usage in usages) for key in ("input_tokens", "cached_tokens",
                                                                             "output_tokens"))  # fmt: skip
    assert outs > 0 and f"{inputs} input tokens ({cached} cached), {outs} output tokens" in stderr


def test_a_background_line_is_refused_not_answered_in_progress():
    """A background response would be an in_progress stub, counted as answered, whose result no one could fetch."""
    from paged_backend.server.batch_lines import parse_lines

    line = {**responses_line("bg", "hi"), "body": {**responses_line("bg", "hi")["body"], "background": True}}
    [parsed] = parse_lines(jsonl([line]).decode())
    assert parsed.problem == "line 1: a batch request runs to its end; remove 'background' from the body"


def test_an_output_folder_that_does_not_exist_is_refused_before_the_run(tmp_path):
    requests = tmp_path / "requests.jsonl"
    requests.write_bytes(jsonl(LINES[:1]))
    command = [str(Path(sys.executable).with_name("paged-backend")), "run-batch", "-i", str(requests),
               "-o", str(tmp_path / "missing" / "out.jsonl"), "--model", MODEL, "--device", "cpu"]  # fmt: skip
    finished = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert finished.returncode == 2 and "Traceback" not in finished.stderr
    assert "--output-file's folder" in finished.stderr and "does not exist" in finished.stderr


def test_an_input_file_that_is_not_utf8_is_one_error(tmp_path):
    """It was one "not valid JSON" error per line, and exit 0."""
    requests = tmp_path / "requests.jsonl"
    requests.write_bytes(b"\xff\xfe\x00binary\n" * 5)
    command = [str(Path(sys.executable).with_name("paged-backend")), "run-batch", "-i", str(requests),
               "-o", str(tmp_path / "out.jsonl"), "--model", MODEL, "--device", "cpu"]  # fmt: skip
    finished = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert finished.returncode == 2 and finished.stderr.strip().splitlines() == [
        "error: --input-file is not UTF-8 text (invalid start byte at byte 0)"]  # fmt: skip
