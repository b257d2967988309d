"""SIGTERM: streams that can finish within --drain-timeout do; the rest are cut; shutdown completes cleanly."""

from __future__ import annotations

import json
import signal
import threading

import httpx

from tests._server_helpers import API_KEY, running_server, stop


def read_stream(url: str, body: dict, first_chunk: threading.Event, result: dict) -> None:
    """Stream a completion; record the finish reason and token count it ended with, or that it was cut."""
    finish = None
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {API_KEY}"}) as response:  # fmt: skip
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                first_chunk.set()
                chunk = json.loads(line[len("data: ") :])
                for choice in chunk.get("choices", []):
                    finish = choice["finish_reason"] or finish
                if "error" in chunk:
                    result["error"] = chunk["error"]["code"]
                if chunk.get("usage"):
                    result["tokens"] = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError:
        result["cut"] = True  # the connection dropped mid-stream
    first_chunk.set()
    result["finish"] = finish


def test_sigterm_drains_short_streams_cuts_endless_ones_and_exits_cleanly(monkeypatch):
    # "endless" must outlast the drain however fast decoding gets: 30000 tokens are ~30 s at 1 ms a token, past
    # the tiny model's 2048 positions, which vLLM's switch allows
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    flags = ("--num-blocks", "2200", "--max-model-len", "32768", "--drain-timeout", "5", "--log-level", "info")
    with running_server(*flags) as server:
        short = {"prompt": "Short", "max_tokens": 24, "stream": True, "ignore_eos": True,
                 "stream_options": {"include_usage": True}}  # fmt: skip
        endless = {**short, "prompt": "Endless", "max_tokens": 30000}
        bodies = [short, short, short, endless]
        results = [{} for _ in bodies]
        started = [threading.Event() for _ in bodies]
        threads = [threading.Thread(target=read_stream, args=(server.url, body, event, result))
                   for body, event, result in zip(bodies, started, results, strict=True)]  # fmt: skip
        for thread in threads:
            thread.start()
        for event in started:
            event.wait(60)
        exit_code = stop(server, timeout=30)
        for thread in threads:
            thread.join(30)
        log = server.output()
    # uvicorn re-raises the captured SIGTERM once its graceful shutdown is done, as process managers expect.
    assert exit_code == -signal.SIGTERM
    assert "Application shutdown complete" in log and "Traceback" not in log
    assert results[:3] == [{"finish": "length", "tokens": 24}] * 3
    assert results[3] == {"finish": None, "error": "service_unavailable"}  # aborted with an error event, not cut
