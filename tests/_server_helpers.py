"""A real `python -m paged_backend.server` on a free loopback port, and readers for what it exposes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import IO, TYPE_CHECKING

import httpx
import pytest

from paged_backend.worker.default_model import TINY_MODEL

if TYPE_CHECKING:  # imported where used: the GPU checks import this module on a machine without openai
    import openai

API_KEY = "test-key"
MODEL = TINY_MODEL  # the fast seeded model, unless a test names another
STARTUP_TIMEOUT = 180  # seconds; importing torch on a busy 2-core box is slow


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """A running server process; `url` is its base address."""

    def __init__(self, process: subprocess.Popen, url: str, log: IO[str]) -> None:
        self.process, self.url, self.log = process, url, log

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def client(self, **kwargs) -> openai.OpenAI:
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=120, **kwargs)

    def async_client(self, **kwargs) -> openai.AsyncOpenAI:
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=120, **kwargs)

    def post(self, path: str, **kwargs) -> httpx.Response:
        headers = {"Authorization": f"Bearer {API_KEY}", **kwargs.pop("headers", {})}
        return httpx.post(f"{self.url}{path}", headers=headers, timeout=120, **kwargs)

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(f"{self.url}/metrics", timeout=30).text)

    def health(self) -> dict:
        response = httpx.get(f"{self.url}/health", timeout=30)
        response.raise_for_status()
        return response.json()

    def wait_until_drained(self, timeout: float = 30) -> dict[str, float]:
        """Metrics once nothing runs or waits and every KV block is free again (fails after `timeout`)."""
        deadline = time.monotonic() + timeout
        while True:
            metrics = self.metrics()
            idle = metrics["paged_backend:num_requests_running"] == 0 == metrics["paged_backend:num_requests_waiting"]
            if idle and metrics["paged_backend:kv_cache_usage_perc"] == 0:
                return metrics
            assert time.monotonic() < deadline, f"server did not drain: {metrics}"
            time.sleep(0.1)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format -> {'name{labels}': value}, comments dropped."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


@contextmanager
def running_server(*flags: str, model: str | None = TINY_MODEL):
    """Start the server with `flags` (plus --api-key, cpu), wait for /health, SIGTERM it afterwards.

    `model` is added as --model unless the flags name one; None starts the server on its default model."""
    port = free_port()
    named = {"--model", "--config"} & set(flags) or (flags and not flags[0].startswith("-"))  # vLLM's positional MODEL
    model = [] if model is None or named else ["--model", model]
    command = [sys.executable, "-m", "paged_backend.server", "--port", str(port), "--device", "cpu",
               "--api-key", API_KEY, "--log-level", "warning", *model, *flags]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryFile("w+") as log:  # a file, not a pipe: a full pipe would block the server
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        server = Server(process, f"http://127.0.0.1:{port}", log)
        try:
            _wait_for_health(server)
            yield server
        finally:
            stop(server)


def stop(server: Server, timeout: float = 60) -> int:
    """SIGTERM (a graceful shutdown); returns the exit code. Fails if the server ignores it."""
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
    try:
        return server.process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()
        raise AssertionError(f"server ignored SIGTERM for {timeout} s:\n{server.output()}") from None


def _wait_for_health(server: Server) -> None:
    wait_for_ok(f"{server.url}/health", server.process, server.output, STARTUP_TIMEOUT)


def wait_for_ok(url: str, process: subprocess.Popen, output: Callable[[], str], timeout: float) -> None:
    """Until GET `url` answers 200; fails at once if `process` exits, or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[0]} exited during start-up:\n{output()}")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{url} not ready after {timeout} s")


def server_fixture(*flags: str):
    """A module-scoped fixture running the server with `flags`: `server = server_fixture("--num-blocks", "64")`."""

    @pytest.fixture(scope="module")
    def server():
        with running_server(*flags) as running:
            yield running

    return server


def client_fixture():
    """A module-scoped fixture: the module's `server` fixture's OpenAI client (`client = client_fixture()`)."""

    @pytest.fixture(scope="module")
    def client(server):
        return server.client()

    return client
