"""Sleep mode's memory: the RSS of a real `serve --enable-sleep-mode` awake, after each sleep level and each wake.

Starts the server (the default model unless --model names another; a KV pool of --pool-mib), runs one greedy
completion, then walks: awake -> POST /sleep?level=1 -> /wake_up -> /sleep?level=2 -> /wake_up, reading the server
process's RSS after each call and timing the call. After each wake the same greedy completion runs again and
must give the same tokens. Prints a Markdown table.

    python benchmarks/sleep_memory.py                       # SmolLM2-135M (GGUF), a 512 MiB pool
    python benchmarks/sleep_memory.py --model paged-backend/embedded-tiny --pool-mib 256
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import psutil

PROMPT = "Sleep mode lets an idle server give its memory back: "


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(model: str | None, pool_bytes: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "paged_backend.server", "--port", str(port), "--device", "cpu",
               "--enable-sleep-mode", "--kv-cache-memory-bytes", str(pool_bytes), "--log-level", "warning",
               *(["--model", model] if model else [])]  # fmt: skip
    log = tempfile.TemporaryFile("w+")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            raise SystemExit(f"the server exited during start-up:\n{log.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    process.kill()
    raise SystemExit("the server did not become healthy in 600 s")


def greedy(url: str) -> list[str]:
    body = {"prompt": PROMPT, "max_tokens": 32, "temperature": 0, "logprobs": 0, "ignore_eos": True,
            "return_tokens_as_token_ids": True}  # fmt: skip
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    response.raise_for_status()
    return response.json()["choices"][0]["logprobs"]["tokens"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="--model for serve (default: the default model)")
    parser.add_argument("--pool-mib", type=int, default=512, help="KV pool size in MiB")
    args = parser.parse_args()
    process, url = start(args.model, args.pool_mib << 20)
    server = psutil.Process(process.pid)

    def rss_mib() -> float:
        return server.memory_info().rss / 2**20

    try:
        reference = greedy(url)
        rows = [("awake (after one completion)", rss_mib(), None, None)]
        for call, label in (("/sleep?level=1", "asleep, level 1"), ("/wake_up", "awake again"),
                            ("/sleep?level=2", "asleep, level 2"), ("/wake_up", "awake again")):  # fmt: skip
            started = time.perf_counter()
            httpx.post(f"{url}{call}", timeout=600).raise_for_status()
            seconds = time.perf_counter() - started
            rss = rss_mib()
            same = greedy(url) == reference if call == "/wake_up" else None
            rows.append((f"{label} (`POST {call}`)", rss, seconds, same))
    finally:
        process.terminate()
        process.wait(60)
    model = args.model or "default (SmolLM2-135M-Instruct GGUF)"
    print(f"model {model}, KV pool {args.pool_mib} MiB, device cpu\n")
    print("| state | server RSS (MiB) | change from awake (MiB) | call took (s) | same greedy tokens |")
    print("|---|---:|---:|---:|---|")
    awake = rows[0][1]
    for label, rss, seconds, same in rows:
        took = "" if seconds is None else f"{seconds:.2f}"
        agreed = "" if same is None else ("yes" if same else "NO")
        print(f"| {label} | {rss:.0f} | {rss - awake:+.0f} | {took} | {agreed} |")


if __name__ == "__main__":
    main()
