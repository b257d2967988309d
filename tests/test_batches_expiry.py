"""A batch's completion window, shortened by `serve --batch-completion-window`: `expires_at` follows it, a batch that
cannot finish in time ends "expired" with its finished lines in the output file and every other line in the error
file as `batch_expired` (OpenAI's accounting), a batch still queued when its window ends expires without running,
and no request or KV block outlives the expiry."""

from __future__ import annotations

import pytest

from tests._server_helpers import running_server
from tests.test_batches_api import chat_line, create, output_lines, summed_usage, upload, wait_until


def endless_line(custom_id: str) -> dict:
    """A line that needs ~1 s of decoding: 1500 tokens, EOS ignored (vLLM's extension)."""
    line = chat_line(custom_id, "Keep going", max_tokens=1500)
    line["body"]["ignore_eos"] = True
    return line


def long_line(custom_id: str) -> dict:
    """~0.2 s of decoding on a fast box: 300 tokens, EOS ignored."""
    line = chat_line(custom_id, "Keep going", max_tokens=300)
    line["body"]["ignore_eos"] = True
    return line


# Seconds. Long enough for the first lines to finish on a loaded box (3 s once was not: lines reach the engine about,
# not exactly, in input order), far too short for the rest: one line at a time, the batch needs ~25 s on this box.
WINDOW = 6
LINES = [chat_line("quick", "Hi", max_tokens=1)] + [long_line(f"long-{i}") for i in range(200)]


# The queued batch's window ends as late after the first's as its create call came: up to ~0.2 s on a busy box, and
# the first batch's expiry is seen up to 0.1 s late. Its lines are too long to finish in that gap.
QUEUED = [endless_line(f"queued-{i}") for i in range(3)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    flags = ("--num-blocks", "256", "--max-model-len", "2048", "--max-num-seqs", "1")
    files = str(tmp_path_factory.mktemp("files"))
    with running_server(*flags, "--files-dir", files, "--batch-completion-window", str(WINDOW)) as running:
        yield running


def test_a_batch_that_cannot_finish_in_its_window_expires_with_openais_accounting(server):
    client = server.client()
    # Both files first, then the two batches back to back: the queued one waits out the first, and its window ends
    # soon after the first's, too soon for one of its lines (QUEUED) to finish. (With 128-token lines it once had
    # time to finish one after the first batch expired.)
    files = [upload(client, lines) for lines in (LINES, QUEUED)]
    created, queued = (create(client, uploaded) for uploaded in files)
    assert created.expires_at == created.created_at + WINDOW and created.expired_at is None
    batch = wait_until(client, created.id, timeout=60)
    assert batch.status == "expired" and batch.expired_at >= batch.expires_at
    assert batch.completed_at is None and batch.finalizing_at is None
    counts = batch.request_counts
    assert counts.total == len(LINES) and 1 <= counts.completed < len(LINES)
    assert counts.completed + counts.failed == len(LINES)
    answered, expired = output_lines(client, batch.output_file_id), output_lines(client, batch.error_file_id)
    assert len(answered) == counts.completed and len(expired) == counts.failed
    assert answered[0]["custom_id"] == "quick"
    assert all(output["response"]["status_code"] == 200 and output["error"] is None for output in answered)
    assert all(output["response"] is None and output["error"]["code"] == "batch_expired" for output in expired)
    ids = [line["custom_id"] for line in LINES]
    assert sorted(output["custom_id"] for output in answered + expired) == sorted(ids)  # every line, once
    expired_ids = {output["custom_id"] for output in expired}
    assert [output["custom_id"] for output in expired] == [i for i in ids if i in expired_ids]  # input order
    assert batch.usage.model_dump() == summed_usage(answered)  # only what finished

    never_ran = wait_until(client, queued.id, timeout=60)
    assert never_ran.status == "expired" and never_ran.output_file_id is None
    assert (never_ran.request_counts.completed, never_ran.request_counts.failed) == (0, 3)
    codes = [output["error"]["code"] for output in output_lines(client, never_ran.error_file_id)]
    assert codes == ["batch_expired"] * 3
    assert never_ran.usage.total_tokens == 0

    # the aborted lines left nothing running or waiting, and every KV block free (usage 0: free == total)
    server.wait_until_drained()
