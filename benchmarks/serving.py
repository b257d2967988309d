"""Online serving: Poisson arrivals at several request rates against the OpenAI completions endpoint.

Per rate: request throughput, output tokens/s, and mean / p50 / p99 of TTFT, TPOT, ITL and end-to-end
latency, measured by streaming clients (one SSE chunk per engine step). Writes a table, a JSON file and a
PNG of latency against load.

    python benchmarks/serving.py                                   # starts the embedded-model server itself
    python benchmarks/serving.py --url http://127.0.0.1:8000 --api-key KEY --request-rates 1,4,16,inf
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import shlex
import socket
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

WORDS = "the paged cache keeps every block of keys and values in one pool so new requests join at once".split()


@dataclass
class RequestResult:
    ok: bool
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""


@dataclass
class RateSummary:
    request_rate: float
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    latency_ms: dict[str, dict[str, float]]  # metric -> {mean, p50, p99}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a running server; default: start `python -m paged_backend.server`")
    parser.add_argument("--server-args", default="--device cpu --num-blocks 2048", help="flags for the started server")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--request-rates", default="2,4,8,16,inf", help="comma list of requests/s; inf = all at once")
    parser.add_argument("--num-prompts", type=int, default=48, help="requests per rate")
    parser.add_argument("--input-len", type=int, default=64, help="prompt length in characters")
    parser.add_argument("--output-len", type=int, default=32, help="max_tokens, EOS ignored")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="benchmarks/serving.json", help="where to write the summaries")
    parser.add_argument("--plot", default="benchmarks/serving.png", help="where to write the latency plot")
    return parser.parse_args()


def prompts(count: int, length: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(length))[:length] for _ in range(count)]


def arrival_delays(count: int, rate: float, seed: int) -> list[float]:
    """Gaps between arrivals: exponential (a Poisson process) at `rate`; all zero for an infinite rate."""
    rng = random.Random(seed)
    return [0.0 if math.isinf(rate) else rng.expovariate(rate) for _ in range(count)]


async def one_request(client: httpx.AsyncClient, url: str, headers: dict, body: dict) -> RequestResult:
    started = time.perf_counter()
    chunk_times: list[float] = []
    tokens = 0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                return RequestResult(ok=False, error=f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    return RequestResult(ok=False, error=chunk["error"]["message"])
                if chunk.get("choices"):
                    chunk_times.append(time.perf_counter())
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as error:
        return RequestResult(ok=False, error=repr(error))
    if not chunk_times:
        return RequestResult(ok=False, error="no output")
    itls = [later - earlier for earlier, later in itertools.pairwise(chunk_times)]
    return RequestResult(True, tokens, chunk_times[0] - started, chunk_times[-1] - started, itls)


async def run_rate(url: str, headers: dict, model: str, rate: float, args: argparse.Namespace) -> RateSummary:
    bodies = [
        {"model": model, "prompt": prompt, "max_tokens": args.output_len, "temperature": 1.0, "seed": index,
         "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        for index, prompt in enumerate(prompts(args.num_prompts, args.input_len, args.seed))
    ]  # fmt: skip
    limits = httpx.Limits(max_connections=args.num_prompts + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        tasks = []
        started = time.perf_counter()
        for body, delay in zip(bodies, arrival_delays(len(bodies), rate, args.seed), strict=True):
            await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one_request(client, url, headers, body)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
    return summarize(rate, results, duration)


def summarize(rate: float, results: list[RequestResult], duration: float) -> RateSummary:
    done = [result for result in results if result.ok]
    for failure in (result for result in results if not result.ok):
        print(f"  failed: {failure.error}", file=sys.stderr)
    samples = {
        "ttft": [result.ttft for result in done],
        "tpot": [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1],
        "itl": [gap for result in done for gap in result.itls],
        "e2e": [result.e2e for result in done],
    }
    latency = {name: _distribution_ms(values) for name, values in samples.items()}
    output_tokens = sum(result.output_tokens for result in done)
    return RateSummary(rate, len(done), len(results) - len(done), duration, len(done) / duration,
                       output_tokens / duration, latency)  # fmt: skip


def _distribution_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": math.nan, "p50": math.nan, "p99": math.nan}
    ordered = sorted(values)

    def percentile(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] * 1000

    return {"mean": statistics.fmean(values) * 1000, "p50": percentile(50), "p99": percentile(99)}


def table(summaries: list[RateSummary]) -> str:
    header = ["rate (req/s)", "done", "failed", "req/s", "out tok/s"]
    for metric in ("ttft", "tpot", "itl", "e2e"):
        header += [f"{metric.upper()} mean/p50/p99 (ms)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for s in summaries:
        cells = [f"{s.request_rate:g}", str(s.completed), str(s.failed), f"{s.request_throughput:.2f}",
                 f"{s.output_throughput:.1f}"]  # fmt: skip
        for metric in ("ttft", "tpot", "itl", "e2e"):
            d = s.latency_ms[metric]
            cells.append(f"{d['mean']:.0f} / {d['p50']:.0f} / {d['p99']:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(summaries: list[RateSummary], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib); skipping the plot")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    achieved = [s.request_throughput for s in summaries]
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    panels = (("ttft", axes[0], "C0"), ("e2e", axes[0], "C1"), ("tpot", axes[1], "C2"), ("itl", axes[1], "C3"))
    for metric, axis, color in panels:
        for quantile, style in (("p50", "-o"), ("p99", "--x")):
            axis.plot(achieved, [s.latency_ms[metric][quantile] for s in summaries], style, color=color,
                      label=f"{metric.upper()} {quantile}")  # fmt: skip
    for axis, title in zip(axes, ("time to first token / end to end", "per output token"), strict=True):
        axis.set(xlabel="achieved request throughput (req/s)", ylabel="latency (ms)", title=title, yscale="log")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"plot: {path}")


@contextmanager
def server(args: argparse.Namespace):
    """The given --url, or a server started here on a free port and stopped afterwards."""
    if args.url:
        yield args.url.rstrip("/")
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "paged_backend.server", "--port", str(port), "--log-level", "warning",
               *shlex.split(args.server_args)]  # fmt: skip
    process = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while not _healthy(url):
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start: {' '.join(command)}")
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(60)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def main() -> None:
    args = parse_args()
    rates = [float(rate) for rate in args.request_rates.split(",")]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with server(args) as url:
        model = httpx.get(f"{url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        print(f"{url} serving {model}: {args.num_prompts} requests per rate, prompt {args.input_len} chars, "
              f"{args.output_len} output tokens")  # fmt: skip
        summaries = []
        for rate in rates:
            summaries.append(asyncio.run(run_rate(url, headers, model, rate, args)))
            print(table(summaries[-1:]).splitlines()[-1], flush=True)
    print(table(summaries))
    Path(args.json).write_text(json.dumps([asdict(s) for s in summaries], indent=2))
    print(f"results: {args.json}")
    plot(summaries, args.plot)


if __name__ == "__main__":
    main()
