"""Time to first token of a high-priority request, on an idle server and beside many low-priority streams.

    python benchmarks/priority_ttft.py                          # the tiny model, 64 streams, priority then fcfs
    python benchmarks/priority_ttft.py --model default          # the real model (SmolLM2-135M-Instruct)

For each policy a real `serve --scheduling-policy POLICY --max-num-seqs STREAMS` starts; its seats are exactly the
low streams', so a newcomer needs one of theirs. `--samples` high-priority requests (priority 0, streamed, 4 tokens)
run one at a time on the idle server (half before the load, half after), and as many while STREAMS clients (in a
process of their own) each stream low-priority completions (priority 10, EOS ignored) back to back, a random pause
apart so they land at any point of a step. Under "priority" the newcomer preempts a low stream and cuts the step in
flight; under fcfs it waits for one to end. Printed: TTFT p50 / p90 per policy and load, the loaded p50 over the
idle p50, the low streams' output tokens per second while sampling, the server's preemptions and cut steps
(`Engine.cut_step_for`) and the machine's load average. The acceptance bound is 2x of idle under priority.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import statistics
import time
from dataclasses import dataclass

import httpx
import openai

from paged_backend.bench.report import markdown_table
from paged_backend.bench.serve import server
from paged_backend.worker.default_model import TINY_MODEL, default_model

HIGH_PROMPT = "Answer at once: what is the capital of France?"
LOW_PROMPT = "Write a long story about a lighthouse keeper and the sea."


@dataclass
class Row:
    policy: str
    load: str
    ttfts: list[float]
    low_tokens_per_s: float | None = None
    preemptions: float | None = None
    cut_steps: float | None = None

    @property
    def p50(self) -> float:
        return statistics.median(self.ttfts)

    @property
    def p90(self) -> float:
        return statistics.quantiles(self.ttfts, n=10, method="inclusive")[-1] if len(self.ttfts) > 1 else self.ttfts[0]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=TINY_MODEL,
                        help="the served model: the seeded tiny model unless given; 'default' is the real one")  # fmt: skip
    parser.add_argument("--policies", default="priority,fcfs", help="comma-separated scheduling policies to compare")
    parser.add_argument("--streams", type=int, default=64, help="low-priority streams running (and --max-num-seqs)")
    parser.add_argument("--samples", type=int, default=20, help="high-priority requests timed per row")
    parser.add_argument("--low-max-tokens", type=int, default=256, help="tokens per low-priority completion")
    parser.add_argument("--server-args", default="", help="more serve flags, e.g. '--device cpu --dtype float32'")
    return parser


async def time_to_first_token(client: openai.AsyncOpenAI, model: str) -> float:
    """Seconds from sending a priority-0 streamed completion to its first token."""
    started = time.perf_counter()
    stream = await client.completions.create(
        model=model, prompt=HIGH_PROMPT, max_tokens=4, stream=True, temperature=0,
        extra_body={"priority": 0, "ignore_eos": True},
    )  # fmt: skip
    first = None
    async for chunk in stream:
        if first is None and chunk.choices:
            first = time.perf_counter() - started
    return first


async def low_stream(http: httpx.AsyncClient, url: str, args: argparse.Namespace, started: asyncio.Event, counts):
    """Back-to-back low-priority completions until cancelled, counting output events (one per token). Read as raw
    server-sent lines: on a small shared machine, parsing 64 streams with the SDK would slow the server it measures."""
    max_tokens = random.randint(1, args.low_max_tokens)  # staggered, so the streams do not all end in the same step
    while True:
        body = {"model": args.model, "prompt": LOW_PROMPT, "max_tokens": max_tokens, "stream": True,
                "temperature": 0, "priority": 10, "ignore_eos": True}  # fmt: skip
        async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    counts.value += 1
                    started.set()
        max_tokens = args.low_max_tokens


async def low_load(url: str, args: argparse.Namespace, counts, ready, stop) -> None:
    """Every low stream, until `stop` is set; `ready` once each has its first token."""
    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=args.streams + 8), timeout=600)
    events = [asyncio.Event() for _ in range(args.streams)]
    lows = [asyncio.create_task(low_stream(http, url, args, event, counts)) for event in events]
    await asyncio.gather(*(event.wait() for event in events))
    ready.set()
    while not stop.is_set():
        await asyncio.sleep(0.05)
    for task in lows:
        task.cancel()
    await asyncio.gather(*lows, return_exceptions=True)
    await http.aclose()


def run_low_load(url: str, args: argparse.Namespace, counts, ready, stop) -> None:
    asyncio.run(low_load(url, args, counts, ready, stop))


def counters(url: str) -> tuple[float, float]:
    """The server's preemptions and cut steps so far."""
    values = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        values[name] = float(value) if name.endswith("_total") else None
    return values.get("paged_backend:num_preemptions_total", float("nan")), values.get(
        "paged_backend:num_cut_steps_total", float("nan")
    )


async def measure(url: str, args: argparse.Namespace, policy: str) -> list[Row]:
    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=args.streams + 8), timeout=600)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", http_client=http, max_retries=0)
    for _ in range(3):  # warm-up: the first requests of a fresh server pay one-time costs
        await time_to_first_token(client, args.model)
    idle = [await time_to_first_token(client, args.model) for _ in range(args.samples // 2)]
    # The load runs in a process of its own, as other clients would: parsing 64 streams on the timing client's event
    # loop would add that loop's queueing to every TTFT it measures.
    context = multiprocessing.get_context("spawn")
    counts, ready, stop = context.Value("q", 0), context.Event(), context.Event()
    load = context.Process(target=run_low_load, args=(url, args, counts, ready, stop), daemon=True)
    load.start()
    while not ready.is_set():
        await asyncio.sleep(0.05)
    await asyncio.sleep(1.0)  # every stream decoding
    before, tokens_before, clock = counters(url), counts.value, time.perf_counter()
    loaded = []
    for _ in range(args.samples):
        await asyncio.sleep(random.uniform(0.05, 0.3))
        loaded.append(await time_to_first_token(client, args.model))
    rate = (counts.value - tokens_before) / (time.perf_counter() - clock)
    preempted, cut = (after - earlier for after, earlier in zip(counters(url), before, strict=True))
    stop.set()
    load.join(timeout=60)
    await asyncio.sleep(1.0)  # the aborted streams leave
    # Idle is sampled before and after the load, so a neighbour's burst on a shared machine skews both sides alike.
    idle += [await time_to_first_token(client, args.model) for _ in range(args.samples - len(idle))]
    await http.aclose()
    return [Row(policy, "idle", idle), Row(policy, f"{args.streams} low streams", loaded, rate, preempted, cut)]


def main(argv: list[str] | None = None) -> list[Row]:
    args = build_parser().parse_args(argv)
    if args.model == "default":
        args.model = default_model()
    rows: list[Row] = []
    print("load average (1, 5, 15 min) at the start: {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()))
    for policy in args.policies.split(","):
        flags = f"--model {args.model} --scheduling-policy {policy} --max-num-seqs {args.streams} {args.server_args}"
        with server(argparse.Namespace(base_url=None, server_args=flags)) as url:
            print(f"{policy}: serve {flags}", flush=True)
            rows += asyncio.run(measure(url, args, policy))
    table = []
    for row in rows:
        idle = next(r for r in rows if r.policy == row.policy and r.load == "idle")
        table.append([
            row.policy, row.load, f"{row.p50 * 1e3:.1f}", f"{row.p90 * 1e3:.1f}", f"{row.p50 / idle.p50:.2f}x",
            "" if row.low_tokens_per_s is None else f"{row.low_tokens_per_s:.0f}",
            "" if row.preemptions is None else f"{row.preemptions:.0f}",
            "" if row.cut_steps is None else f"{row.cut_steps:.0f}",
        ])  # fmt: skip
    header = ["policy", "server", "TTFT p50 (ms)", "TTFT p90 (ms)", "p50 / idle p50", "low tok/s", "preemptions",
              "cut steps"]  # fmt: skip
    print(markdown_table(header, table))
    print("load average (1, 5, 15 min) at the end: {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()))
    return rows


if __name__ == "__main__":
    main()
