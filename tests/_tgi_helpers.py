"""TGI test plumbing: `python -m paged_backend.tgi` / the shard as subprocesses on free ports and sockets."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import IO

import httpx
import uvicorn
from huggingface_hub import InferenceClient
from text_generation import Client

from paged_backend.tgi.proto import generate_pb2 as pb
from paged_backend.tgi.router.backend import warmup_chooser
from paged_backend.worker.default_model import TINY_MODEL
from tests._server_helpers import parse_metrics

STARTUP_TIMEOUT = 240  # seconds; importing torch on a busy 2-core box is slow
# Small pool and context so each server starts fast; greedy requests stay well inside both.
PROMPTS = ["Hello world", "The quick brown fox"]
MAX_NEW_TOKENS = 12
SERVER_ARGS = ["--device", "cpu", "--max-total-tokens", "512", "--max-batch-total-tokens", "4096"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Process:
    """A child process with its output in a temp file (shown when a test needs it)."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.log: IO[str] = tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen(
            [sys.executable, *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(f"process exited with {self.process.returncode}:\n{self.output()}")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        return self.process.returncode


class TgiServer(Process):
    def __init__(
        self, backend: str, extra_args: list[str] = (), env: dict[str, str] | None = None, server_args=SERVER_ARGS
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.backend = backend
        args = ["-m", "paged_backend.tgi", "--backend", backend, "--hostname", "127.0.0.1", "--port", str(self.port)]
        model = [] if "--model-id" in extra_args else ["--model-id", TINY_MODEL]  # the fast seeded model by default
        super().__init__([*args, *model, *server_args, *extra_args], env)

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT) -> TgiServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.backend} server not healthy after {timeout}s:\n{self.output()}")

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(f"{self.url}/metrics", timeout=30).text)

    def wait_until_drained(self, timeout: float = 30) -> dict[str, float]:
        """Metrics once nothing runs and every KV token slot is free again (fails after `timeout`)."""
        deadline = time.monotonic() + timeout
        while True:
            metrics = self.metrics()
            if metrics["tgi_batch_current_max_tokens"] == 0 and metrics["tgi_batch_current_size"] == 0:
                return metrics
            if time.monotonic() > deadline:
                raise AssertionError(f"KV still held after {timeout}s: {metrics}")
            time.sleep(0.2)


class Shard(Process):
    """`python -m paged_backend.tgi.shard serve` on a unix socket `{uds_path}-0`."""

    def __init__(self, uds_path: str, extra_args: list[str] = ()) -> None:
        self.uds_path = uds_path
        self.socket_path = f"{uds_path}-0"
        args = ["-m", "paged_backend.tgi.shard", "serve", TINY_MODEL, "--uds-path", uds_path, *extra_args]
        super().__init__(args, {"PAGED_BACKEND_DEVICE": "cpu"})

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT) -> Shard:
        # TGI's launcher takes the socket file's existence as readiness.
        deadline = time.monotonic() + timeout
        while not Path(self.socket_path).exists():
            self.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"shard socket {self.socket_path} missing after {timeout}s:\n{self.output()}")
            time.sleep(0.2)
        return self


@contextmanager
def running(*processes: Process):
    """Start-up runs in parallel (each child imports torch); every child is stopped on exit."""
    with ExitStack() as stack:
        for process in processes:
            stack.callback(process.stop)
        for process in processes:
            process.wait_ready()
        yield processes


BACKENDS = ("paged", "reference", "grpc")
# Small prefill budget and eager concatenation so the Python router batches often in short tests.
ROUTER_ARGS = ["--max-batch-prefill-tokens", "512", "--waiting-served-ratio", "1.2", "--max-waiting-tokens", "3"]


@contextmanager
def every_backend(shard_blocks: int, extra_args: list[str] = (), dtype: str | None = None):
    """`paged`, `reference` and `grpc` (our router driving our shard) servers, keyed by backend name.

    `dtype` (TGI's `--dtype`) goes to every engine, the shard's included; None leaves each on `--dtype auto`."""
    directory = tempfile.mkdtemp(prefix="tgi-", dir="/tmp")  # unix socket paths must stay short
    uds_path = f"{directory}/shard"
    dtype_args = ["--dtype", dtype] if dtype else []
    shard = Shard(uds_path, ["--num-blocks", str(shard_blocks), "--device", "cpu", *dtype_args])
    in_process = [TgiServer("paged", [*extra_args, *dtype_args]), TgiServer("reference", [*extra_args, *dtype_args])]
    try:
        with running(shard, *in_process):
            # The router warms the shard up at start, so it starts once the shard's socket exists.
            grpc_args = ["--shard-uds-path", uds_path, *ROUTER_ARGS, *extra_args]
            with running(TgiServer("grpc", grpc_args)) as (grpc_server,):
                yield {server.backend: server for server in [*in_process, grpc_server]}
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def greedy_texts(url: str) -> dict[str, str]:
    """Every client path's greedy text for each prompt, keyed by path."""
    client = Client(url, timeout=120)
    hub = InferenceClient(model=url, timeout=120)
    texts = {}
    for prompt in PROMPTS:
        texts[f"generate:{prompt}"] = client.generate(prompt, max_new_tokens=MAX_NEW_TOKENS).generated_text
        last = list(client.generate_stream(prompt, max_new_tokens=MAX_NEW_TOKENS))[-1]
        texts[f"generate_stream:{prompt}"] = last.generated_text
        texts[f"hub:{prompt}"] = hub.text_generation(prompt, max_new_tokens=MAX_NEW_TOKENS)
        chat = hub.chat_completion([{"role": "user", "content": prompt}], max_tokens=MAX_NEW_TOKENS, temperature=0)
        texts[f"chat:{prompt}"] = chat.choices[0].message.content
    return texts


@contextmanager
def serving_in_thread(app):
    """Serve an ASGI app with uvicorn on a loopback port in this process (real HTTP streaming, no start-up cost).

    Yields the base URL; the server and its lifespan stop on exit.
    """
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("in-thread server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def warmup_request(max_input: int, max_total: int) -> pb.WarmupRequest:
    truncate = 20
    image = pb.InputChunk(image=pb.Image(data=b"\xff\xd8", mimetype="image/jpeg"))
    chunks = [image, pb.InputChunk(text="_test " * truncate)]
    params = warmup_chooser()
    stopping = pb.StoppingCriteriaParameters(max_new_tokens=max_total - truncate, ignore_eos_token=True)
    requests = [
        pb.Request(
            id=0,
            inputs="![](data:image/jpeg;base64,/9g=)" + "_test " * truncate,
            input_chunks=pb.Input(chunks=chunks),
            truncate=truncate,
            parameters=params,
            stopping_parameters=stopping,
            prefill_logprobs=True,
            top_n_tokens=20,
            add_special_tokens=True,
        )
        for _ in range(3)
    ]
    warmup_batch = pb.Batch(id=0, requests=requests, size=3, max_tokens=max_input)
    return pb.WarmupRequest(
        batch=warmup_batch, max_input_tokens=max_input, max_prefill_tokens=512, max_total_tokens=max_total
    )
