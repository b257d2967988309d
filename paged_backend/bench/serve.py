"""Online serving benchmark against any OpenAI-compatible server (`serve`, `launch`'s /v1, vLLM, TGI).

Requests arrive as a Poisson process at each --request-rate (inf: all at once), optionally capped at
--max-concurrency in flight. Streaming clients time every chunk: TTFT, TPOT, ITL and end-to-end latency
(mean and percentiles), request and token throughput, and goodput: the requests per second that met every
SLO given as `--goodput ttft:200 tpot:50 e2el:2000` (milliseconds, vLLM's keys). Prints a table, writes
JSON and a PNG of latency against achieved load.

    paged-backend bench serve --base-url http://127.0.0.1:8000 --request-rate 1,4,16,inf --goodput ttft:200 tpot:50
    paged-backend bench serve --base-url http://127.0.0.1:3000 --max-concurrency 8   # launch's TGI /v1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import random
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

from paged_backend.bench.report import distribution_ms, markdown_table, write_json, write_plot
from paged_backend.errors import InvalidRequest

WORDS = "the paged cache keeps every block of keys and values in one pool so new requests join at once".split()
SLO_KEYS = ("ttft", "tpot", "e2el")
METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestResult:
    ok: bool
    output_tokens: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2el - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


@dataclass
class RateSummary:
    request_rate: float
    max_concurrency: int | None
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    goodput: float | None  # requests/s meeting every SLO; None without --goodput
    latency_ms: dict[str, dict[str, float]]  # metric -> {mean, p50, p99, ...}


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(
        prog="paged-backend bench serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--base-url",
        "--url",
        dest="base_url",
        default=None,
        help="a running server; default: start `python -m paged_backend.server` here",
    )
    parser.add_argument("--server-args", default="--device cpu --num-blocks 2048", help="flags for the started server")
    parser.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    parser.add_argument("--model", default=None, help="model name; default: the first of /v1/models")
    parser.add_argument("--api-key", default=None)
    parser.add_argument(
        "--request-rate",
        "--request-rates",
        dest="request_rate",
        default="inf",
        help="comma list of requests/s (Poisson arrivals); inf = all at once",
    )
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    parser.add_argument("--num-prompts", type=int, default=48, help="requests per rate")
    parser.add_argument(
        "--random-input-len", "--input-len", dest="input_len", type=int, default=64, help="prompt length in words"
    )
    parser.add_argument(
        "--random-output-len", "--output-len", dest="output_len", type=int, default=32, help="max_tokens per request"
    )
    parser.add_argument("--ignore-eos", action="store_true", help="ask the server to run to max_tokens (vLLM field)")
    parser.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="SLOs in milliseconds, e.g. ttft:200 tpot:50 e2el:2000",
    )
    parser.add_argument("--metric-percentiles", default="50,99", help="comma list of percentiles to report")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", "--json", dest="output_json", default="bench-serve.json")
    parser.add_argument("--plot", default="bench-serve.png", help="PNG of latency against load ('' for none)")
    return parser  # fmt: skip


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """`["ttft:200", "tpot:50"]` -> {"ttft": 0.2, "tpot": 0.05} (seconds); unknown keys are an error."""
    slos = {}
    for item in items or []:
        key, _, value = item.partition(":")
        if key not in SLO_KEYS or not value:
            raise SystemExit(f"--goodput takes KEY:MILLISECONDS with KEY one of {', '.join(SLO_KEYS)}; got {item!r}")
        slos[key] = float(value) / 1000
    return slos


def prompts(count: int, length: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(length)) for _ in range(count)]


def arrival_delays(count: int, rate: float, seed: int) -> list[float]:
    """Gaps between arrivals: exponential (a Poisson process) at `rate`; all zero for an infinite rate."""
    rng = random.Random(seed)
    return [0.0 if math.isinf(rate) else rng.expovariate(rate) for _ in range(count)]


def request_body(args: argparse.Namespace, model: str, prompt: str, index: int) -> dict:
    body = {"model": model, "max_tokens": args.output_len, "stream": True, "seed": index, "temperature": 1.0,
            "stream_options": {"include_usage": True}}  # fmt: skip
    if args.endpoint.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if args.ignore_eos:
        body["ignore_eos"] = True
    return body


async def one_request(client, url: str, headers: dict, body: dict) -> RequestResult:
    """One streamed request: chunk arrival times, and the token count (usage if sent, else content chunks)."""
    import httpx

    started = time.perf_counter()
    chunk_times: list[float] = []
    usage_tokens = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                return RequestResult(ok=False, error=f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data:") :])
                if "error" in chunk:
                    return RequestResult(ok=False, error=str(chunk["error"]))
                if any(_content(choice) for choice in chunk.get("choices") or []):
                    chunk_times.append(time.perf_counter())
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as error:
        return RequestResult(ok=False, error=repr(error))
    if not chunk_times:
        return RequestResult(ok=False, error="no output")
    itls = [later - earlier for earlier, later in itertools.pairwise(chunk_times)]
    tokens = usage_tokens if usage_tokens is not None else len(chunk_times)
    return RequestResult(True, tokens, chunk_times[0] - started, chunk_times[-1] - started, itls)


def _content(choice: dict) -> bool:
    return bool(choice.get("text") or (choice.get("delta") or {}).get("content"))


async def run_rate(url: str, headers: dict, model: str, rate: float, args: argparse.Namespace) -> RateSummary:
    import httpx

    bodies = [
        request_body(args, model, p, i) for i, p in enumerate(prompts(args.num_prompts, args.input_len, args.seed))
    ]
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else contextlib.nullcontext()

    async def limited(client, body):
        async with limit:
            return await one_request(client, f"{url}{args.endpoint}", headers, body)

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=args.num_prompts + 8)) as client:
        tasks = []
        started = time.perf_counter()
        for body, delay in zip(bodies, arrival_delays(len(bodies), rate, args.seed), strict=True):
            await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(limited(client, body)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
    return summarize(rate, args.max_concurrency, results, duration, parse_goodput(args.goodput), percentiles(args))


def percentiles(args: argparse.Namespace) -> list[float]:
    return [float(q) for q in args.metric_percentiles.split(",")]


def meets(result: RequestResult, slos: dict[str, float]) -> bool:
    values = {"ttft": result.ttft, "tpot": result.tpot or 0.0, "e2el": result.e2el}
    return all(values[key] <= limit for key, limit in slos.items())


def summarize(rate, concurrency, results, duration, slos, quantiles=(50, 99)) -> RateSummary:
    done = [result for result in results if result.ok]
    for failure in (result for result in results if not result.ok):
        print(f"  failed: {failure.error}", file=sys.stderr)
    samples = {
        "ttft": [r.ttft for r in done],
        "tpot": [r.tpot for r in done if r.tpot is not None],
        "itl": [gap for r in done for gap in r.itls],
        "e2el": [r.e2el for r in done],
    }
    latency = {name: distribution_ms(values, quantiles) for name, values in samples.items()}
    goodput = sum(meets(r, slos) for r in done) / duration if slos else None
    output_tokens = sum(r.output_tokens for r in done)
    return RateSummary(rate, concurrency, len(done), len(results) - len(done), duration, len(done) / duration,
                       output_tokens / duration, goodput, latency)  # fmt: skip


def table(summaries: list[RateSummary]) -> str:
    stats = list(summaries[0].latency_ms["ttft"]) if summaries else ["mean", "p50", "p99"]
    header = ["rate (req/s)", "concurrency", "done", "failed", "req/s", "out tok/s", "goodput (req/s)"]
    header += [f"{metric.upper()} {'/'.join(stats)} (ms)" for metric in METRICS]
    rows = []
    for s in summaries:
        row = [f"{s.request_rate:g}", str(s.max_concurrency or "-"), str(s.completed), str(s.failed),
               f"{s.request_throughput:.2f}", f"{s.output_throughput:.1f}",
               "-" if s.goodput is None else f"{s.goodput:.2f}"]  # fmt: skip
        row += [" / ".join(f"{s.latency_ms[m][k]:.0f}" for k in stats) for m in METRICS]
        rows.append(row)
    return markdown_table(header, rows)


def draw(summaries: list[RateSummary]):
    def figure(plt):
        achieved = [s.request_throughput for s in summaries]
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        stats = [k for k in summaries[0].latency_ms["ttft"] if k != "mean"]
        panels = (("ttft", axes[0], "C0"), ("e2el", axes[0], "C1"), ("tpot", axes[1], "C2"), ("itl", axes[1], "C3"))
        for metric, axis, color in panels:
            for stat, style in zip(stats, ("-o", "--x", ":s", "-.^"), strict=False):
                axis.plot(achieved, [s.latency_ms[metric][stat] for s in summaries], style, color=color,
                          label=f"{metric.upper()} {stat}")  # fmt: skip
        for axis, title in zip(axes, ("time to first token / end to end", "per output token"), strict=True):
            axis.set(xlabel="achieved request throughput (req/s)", ylabel="latency (ms)", title=title, yscale="log")
            axis.grid(alpha=0.3)
            axis.legend(fontsize=8)
        return fig

    return figure


@contextlib.contextmanager
def server(args: argparse.Namespace):
    """The given --base-url, or a server started here on a free port and stopped afterwards."""
    import httpx

    if args.base_url:
        yield args.base_url.rstrip("/")
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
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start: {' '.join(command)}")
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(60)


def served_model(url: str, headers: dict) -> str:
    """The first model of the server's /v1/models, or an error saying why there is none to ask for."""
    import httpx

    response = httpx.get(f"{url}/v1/models", headers=headers, timeout=30)
    try:
        return response.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError) as error:
        raise InvalidRequest(f"{url}/v1/models answered HTTP {response.status_code} without a model "
                             f"({response.text[:120]!r}); give --model, or --base-url of an OpenAI-compatible "
                             "server") from error  # fmt: skip


def main(argv: list[str] | None = None) -> list[RateSummary]:
    args = build_parser().parse_args(argv)
    rates = [float(rate) for rate in args.request_rate.split(",")]
    parse_goodput(args.goodput)  # a bad SLO fails before any request
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with server(args) as url:
        model = args.model or served_model(url, headers)
        print(f"{url}{args.endpoint} serving {model}: {args.num_prompts} requests per rate, prompt {args.input_len} "
              f"words, {args.output_len} output tokens, concurrency {args.max_concurrency or 'unbounded'}")  # fmt: skip
        summaries = []
        for rate in rates:
            summaries.append(asyncio.run(run_rate(url, headers, model, rate, args)))
            print(table(summaries[-1:]).splitlines()[-1], flush=True)
    print(table(summaries))
    write_json(args.output_json, {"base_url": url, "endpoint": args.endpoint, "model": model,
                                  "goodput_slos_ms": {k: v * 1000 for k, v in parse_goodput(args.goodput).items()},
                                  "results": [asdict(s) for s in summaries]})  # fmt: skip
    write_plot(args.plot, draw(summaries))
    return summaries
