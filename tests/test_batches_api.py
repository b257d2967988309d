"""/v1/files and /v1/batches through the official openai client against a real server: every batch answer equals
the online answer to the same request, malformed lines become error lines while the others run, cancel and list
work, an oversized upload is a 413, and a batch interrupted by a restart finishes with every line exactly once.
The batch's `usage` sums its lines' own usage (once each, across a restart), and on a two-model server every line
runs on the model its body names (an unknown model: the online 404)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from paged_backend.server.batch_lines import line_usage
from tests._server_helpers import MODEL, running_server

# Batch-invariant float32: a line's greedy tokens do not depend on which other lines share its engine steps.
EXACT = ("--batch-invariant", "--dtype", "float32", "--num-blocks", "256", "--max-model-len", "256")
MAX_FILE_BYTES = 64 * 1024
FINISHED = ("completed", "failed", "cancelled", "expired")


def chat_line(custom_id: str, text: str, max_tokens: int = 8) -> dict:
    messages = [{"role": "user", "content": text}]
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def completion_line(custom_id: str, prompt: str, max_tokens: int = 8) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}


def jsonl(records: list) -> bytes:
    return "".join((record if isinstance(record, str) else json.dumps(record)) + "\n" for record in records).encode()


def comparable(body: dict) -> dict:
    """An answer without what differs between two calls of the same request (its id and creation time)."""
    return {key: value for key, value in body.items() if key not in ("id", "created", "created_at")}


def online_answer(server, line: dict) -> tuple[int, dict]:
    response = server.post(line["url"], json=line["body"])
    return response.status_code, response.json()


def online_answers(server, lines: list[dict]) -> list[dict]:
    """The online answers' bodies, asked all at once (the server batches them; batch-invariant, so exact)."""
    with ThreadPoolExecutor(len(lines)) as pool:
        return [body for _, body in pool.map(lambda line: online_answer(server, line), lines)]


def upload(client: openai.OpenAI, lines: list) -> openai.types.FileObject:
    return client.files.create(file=("requests.jsonl", jsonl(lines)), purpose="batch")


def create(client: openai.OpenAI, uploaded, endpoint: str = "/v1/chat/completions") -> openai.types.Batch:
    return client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h")


def submit(client: openai.OpenAI, lines: list, endpoint: str = "/v1/chat/completions") -> openai.types.Batch:
    return create(client, upload(client, lines), endpoint)


def wait_until(client: openai.OpenAI, batch_id: str, statuses=FINISHED, timeout: float = 120) -> openai.types.Batch:
    deadline = time.monotonic() + timeout
    while (batch := client.batches.retrieve(batch_id)).status not in statuses:
        assert time.monotonic() < deadline, f"batch still {batch.status} after {timeout} s: {batch}"
        time.sleep(0.1)
    return batch


def output_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [] if file_id is None else [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def summed_usage(outputs: list[dict]) -> dict:
    """OpenAI's batch usage, summed here from the output lines' own usage (chat and completions names)."""
    usages = [output["response"]["body"]["usage"] for output in outputs]
    inputs, outs = sum(u["prompt_tokens"] for u in usages), sum(u["completion_tokens"] for u in usages)
    cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in usages)
    return {"input_tokens": inputs, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": outs,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": inputs + outs}  # fmt: skip


@pytest.fixture(scope="module")
def files_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("files")


@pytest.fixture(scope="module")
def server(files_dir):
    with running_server(*EXACT, "--files-dir", str(files_dir), "--max-file-bytes", str(MAX_FILE_BYTES)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_batch_answers_equal_the_online_answers(server, client):
    lines = [chat_line(f"chat-{i}", f"Question {i}: what is a paged cache?", max_tokens=4 + i) for i in range(6)]
    before = server.metrics()
    created = submit(client, lines)
    assert created.status == "validating" and created.request_counts.total == 6
    batch = wait_until(client, created.id)
    assert batch.status == "completed" and batch.error_file_id is None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (6, 0)
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    outputs = output_lines(client, batch.output_file_id)
    assert [output["custom_id"] for output in outputs] == [line["custom_id"] for line in lines]  # input order
    for line, output in zip(lines, outputs, strict=True):
        status, online = online_answer(server, line)
        assert output["error"] is None and output["response"]["status_code"] == status == 200
        assert comparable(output["response"]["body"]) == comparable(online)
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"
    assert batch.usage.model_dump() == summed_usage(outputs) and batch.usage.output_tokens > 0
    # the lines ran in the batch class; the online answers compared against them in the interactive one
    after, key = server.metrics(), 'paged_backend:requests_by_class_total{request_class="%s"}'
    assert after.get(key % "batch", 0) - before.get(key % "batch", 0) == 6
    assert after.get(key % "interactive", 0) - before.get(key % "interactive", 0) == 6


def test_completions_batch_equals_the_online_answers(server, client):
    lines = [completion_line(f"text-{i}", f"The cache holds block {i}", max_tokens=6) for i in range(4)]
    batch = wait_until(client, submit(client, lines, endpoint="/v1/completions").id)
    outputs = output_lines(client, batch.output_file_id)
    assert [output["custom_id"] for output in outputs] == [line["custom_id"] for line in lines]
    for output, online in zip(outputs, online_answers(server, lines), strict=True):
        assert comparable(output["response"]["body"]) == comparable(online)


def test_a_file_saved_with_a_byte_order_mark_runs_from_its_first_line(client):
    lines = [completion_line(f"bom-{i}", "The cache holds", max_tokens=2) for i in range(2)]
    uploaded = client.files.create(file=("windows.jsonl", b"\xef\xbb\xbf" + jsonl(lines)), purpose="batch")
    batch = wait_until(client, create(client, uploaded, "/v1/completions").id)
    assert (batch.request_counts.completed, batch.request_counts.failed) == (2, 0), batch  # line 1 failed: "BOM"


def test_malformed_lines_become_error_lines_and_the_others_still_run(server, client):
    good = chat_line("good", "Still answered?")
    rejected = chat_line("rejected", "Too many tokens", max_tokens=10_000)  # the route's own 400
    surrogate = chat_line("surrogate", "\ud800")  # a lone surrogate: the route's 400 too, not the batch's failure
    lines = [
        "{not json",
        {**chat_line("wrong-url", "x"), "url": "/v1/embeddings"},
        {key: value for key, value in chat_line("", "no id").items() if key != "custom_id"},
        {**completion_line("other-endpoint", "x")},
        good,
        rejected,
        surrogate,
        {**chat_line("streaming", "x"), "body": {**chat_line("streaming", "x")["body"], "stream": True}},
        chat_line("good", "a second line with the same custom_id"),
    ]
    batch = wait_until(client, submit(client, lines).id)
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (9, 1, 8)
    [answered] = output_lines(client, batch.output_file_id)
    assert answered["custom_id"] == "good"
    assert comparable(answered["response"]["body"]) == comparable(online_answer(server, good)[1])
    errors = output_lines(client, batch.error_file_id)
    assert [error["custom_id"] for error in errors] == [None, "wrong-url", None, "other-endpoint", "rejected",
                                                        "surrogate", "streaming", "good"]  # fmt: skip
    unsent = [error for error in errors if error["custom_id"] not in ("rejected", "surrogate")]
    assert all(error["response"] is None and error["error"]["code"] == "invalid_request" for error in unsent)
    messages = [error["error"]["message"] for error in unsent]
    for message, expected in zip(messages, ["not valid JSON", "unknown url", "custom_id", "differs from the batch's "
                                            "endpoint", "cannot stream", "reuses custom_id"], strict=True):  # fmt: skip
        assert expected in message
    [route_error] = [error for error in errors if error["custom_id"] == "rejected"]
    status, online = online_answer(server, rejected)
    assert route_error["error"] is None and route_error["response"]["status_code"] == status == 400
    assert route_error["response"]["body"] == online
    [route_error] = [error for error in errors if error["custom_id"] == "surrogate"]
    assert route_error["response"]["status_code"] == 400 and "Unicode" in str(route_error["response"]["body"])


def test_cancel_stops_a_batch_with_the_outputs_it_has(client):
    lines = [chat_line(f"long-{i}", f"Tell me about block {i}", max_tokens=32) for i in range(200)]
    created = submit(client, lines)
    cancelling = client.batches.cancel(created.id)
    assert cancelling.status in ("cancelling", "cancelled")
    batch = wait_until(client, created.id)
    assert batch.status == "cancelled" and batch.cancelling_at and batch.cancelled_at
    outputs = output_lines(client, batch.output_file_id)
    assert len(outputs) == batch.request_counts.completed < 200
    with pytest.raises(openai.BadRequestError, match="already cancelled"):
        client.batches.cancel(created.id)


def test_list_pages_newest_first(client):
    ids = [submit(client, [chat_line("one", "hi", max_tokens=1)]).id for _ in range(3)]
    listed = [batch.id for batch in client.batches.list(limit=100)]
    assert listed[:3] == ids[::-1]
    first_page = client.batches.list(limit=2)
    assert [batch.id for batch in first_page.data] == ids[:0:-1] and first_page.has_more
    assert [batch.id for batch in client.batches.list(limit=2, after=ids[1])][:1] == [ids[0]]
    assert [batch.id for batch in client.batches.list()] == listed[:20]  # everything, page after page
    for batch_id in ids:
        wait_until(client, batch_id)


def test_files_upload_retrieve_content_list_and_delete(client):
    content = jsonl([chat_line("a", "hello")])
    uploaded = client.files.create(file=("mine.jsonl", content), purpose="batch")
    assert (uploaded.object, uploaded.purpose, uploaded.filename, uploaded.bytes) == ("file", "batch", "mine.jsonl",
                                                                                      len(content))  # fmt: skip
    assert client.files.retrieve(uploaded.id) == uploaded
    assert client.files.content(uploaded.id).content == content
    assert uploaded.id in [each.id for each in client.files.list(purpose="batch")]
    deleted = client.files.delete(uploaded.id)
    assert deleted.deleted and deleted.id == uploaded.id
    with pytest.raises(openai.NotFoundError, match="no file"):
        client.files.retrieve(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")


def test_bad_batch_requests_are_4xx_naming_what_to_change(client):
    with pytest.raises(openai.APIStatusError) as oversized:
        client.files.create(file=("big.jsonl", b"x" * (MAX_FILE_BYTES + 1)), purpose="batch")
    assert oversized.value.status_code == 413
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("a.jsonl", b"{}"), purpose="fine-tune")
    empty = client.files.create(file=("empty.jsonl", b"\n\n"), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="no request lines"):
        client.batches.create(input_file_id=empty.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=empty.id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.NotFoundError, match="no batch"):
        client.batches.retrieve("batch_nope")
    with pytest.raises(openai.BadRequestError, match="completion_window") as window:
        client.batches.create(input_file_id=empty.id, endpoint="/v1/chat/completions", completion_window="1h")
    assert window.value.body["type"] == "invalid_request_error"


def test_a_file_upload_missing_a_part_names_the_part(server):
    """/v1/files takes multipart: its own errors name the part, never "send the body as JSON"."""
    for form, files, named in (({}, {"file": ("a.jsonl", b"{}")}, "purpose"), ({"purpose": "batch"}, None, "file")):
        response = server.post("/v1/files", data=form, files=files)
        assert response.status_code == 400, response.text
        message = response.json()["error"]["message"]
        assert named in message and "JSON" not in message, message


def test_line_usage_reads_every_endpoints_names():
    def output(usage, status=200):
        return {"response": {"status_code": status, "body": {"usage": usage}}, "error": None}

    keys = ("input_tokens", "cached_tokens", "output_tokens", "reasoning_tokens")
    chat = {"prompt_tokens": 5, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 2}}
    responses = {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 2,
                 "output_tokens_details": {"reasoning_tokens": 1}}  # fmt: skip
    assert line_usage(output(chat)) == dict(zip(keys, (5, 2, 3, 0), strict=True))
    assert line_usage(output(responses)) == dict(zip(keys, (7, 4, 2, 1), strict=True))
    unsent = {"response": None, "error": {"code": "invalid_request"}}
    zero = dict.fromkeys(keys, 0)
    assert line_usage(unsent) == line_usage(output(None, 400)) == line_usage(output({"prompt_tokens": "x"})) == zero


def test_a_batch_resumes_after_a_restart_without_redoing_lines(tmp_path):
    # Two lines at a time, 160 tokens each past EOS: ~12 x 160 steps, seconds of work on a busy CI box, so the batch
    # is still running when the server stops (16 tokens a line once let it finish before the stop took effect).
    lines = [chat_line(f"line-{i}", f"Resume item {i}", max_tokens=160) for i in range(24)]
    for line in lines:
        line["body"]["ignore_eos"] = True
    slow = ("--max-num-seqs", "2")
    with running_server(*EXACT, *slow, "--files-dir", str(tmp_path)) as first:
        client = first.client()
        created = submit(client, lines)
        deadline = time.monotonic() + 120
        while (batch := client.batches.retrieve(created.id)).request_counts.completed < 2:
            assert batch.status == "in_progress" or batch.status == "validating", batch
            assert time.monotonic() < deadline, batch
            time.sleep(0.05)
    results = (tmp_path / "batches" / f"{created.id}.results.jsonl").read_text().splitlines()
    assert 2 <= len(results) < len(lines), "the batch finished before the stop; the test needs a longer batch"
    with running_server(*EXACT, "--files-dir", str(tmp_path)) as second:
        client = second.client()
        batch = wait_until(client, created.id)
        assert batch.status == "completed" and batch.request_counts.completed == len(lines)
        outputs = output_lines(client, batch.output_file_id)
        assert [output["custom_id"] for output in outputs] == [line["custom_id"] for line in lines]  # each once
        for output, online in zip(outputs, online_answers(second, lines), strict=True):
            assert comparable(output["response"]["body"]) == comparable(online)
        assert batch.usage.model_dump() == summed_usage(outputs)  # the lines run before the stop counted once
    stored = (tmp_path / "batches" / f"{created.id}.results.jsonl").read_text().splitlines()
    assert sorted(json.loads(result)["line"] for result in stored) == list(range(1, len(lines) + 1))


def test_each_line_runs_on_the_model_its_body_names(tmp_path):
    served = ("--model", MODEL, "--model", MODEL, "--served-model-name", "first", "--served-model-name", "second")
    with running_server(*EXACT, *served, "--files-dir", str(tmp_path)) as server:
        client = server.client()
        lines = []
        for i, model in enumerate(["second", "first", "second", "nope", "second", "first"]):
            line = chat_line(f"{model}-{i}", f"Which model answers line {i}?", max_tokens=4 + i)
            lines.append({**line, "body": {**line["body"], "model": model}})
        before = server.metrics()
        batch = wait_until(client, submit(client, lines).id)
        assert batch.status == "completed"
        assert (batch.request_counts.completed, batch.request_counts.failed) == (5, 1)
        outputs = output_lines(client, batch.output_file_id)
        assert [output["custom_id"] for output in outputs] == [line["custom_id"] for line in lines if "nope" not in
                                                               line["custom_id"]]  # fmt: skip
        answered = [line for line in lines if line["body"]["model"] != "nope"]
        for line, output in zip(answered, outputs, strict=True):
            status, online = online_answer(server, line)
            assert output["response"]["status_code"] == status == 200
            assert output["response"]["body"]["model"] == line["body"]["model"]
            assert comparable(output["response"]["body"]) == comparable(online)
        [unknown] = output_lines(client, batch.error_file_id)
        status, online = online_answer(server, lines[3])
        assert unknown["response"]["status_code"] == status == 404 and unknown["response"]["body"] == online
        assert "'first'" in online["error"]["message"] and "'second'" in online["error"]["message"]
        after = server.metrics()
        for model, count in (("first", 2), ("second", 3)):  # each engine ran its own lines, in the batch class
            assert batch_requests(after, model) - batch_requests(before, model) == count
        assert "another server runs the batches" not in server.output()  # one runner, no false warning


def batch_requests(metrics: dict[str, float], model: str) -> float:
    """`requests_by_class_total` of the batch class on one model of a multi-model server (labels in any order)."""
    labels = (f'model_name="{model}"', 'request_class="batch"')
    counters = {key: value for key, value in metrics.items() if key.startswith("paged_backend:requests_by_class_total")}
    return sum(value for key, value in counters.items() if all(label in key for label in labels))
