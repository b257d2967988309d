"""Benchmark workloads: token-id prompts with the number of tokens each request must produce."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from paged_backend.errors import InvalidRequest


def synthetic_workload(num_requests: int, seed: int, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    """Long-tailed (log-normal) prompt and output lengths: most short, a few long."""
    rng = random.Random(seed)

    def length(median: float, low: int, high: int) -> int:
        return max(low, min(high, int(rng.lognormvariate(math.log(median), 0.75))))

    prompts = [[rng.randrange(vocab_size) for _ in range(length(48, 4, 512))] for _ in range(num_requests)]
    outputs = [length(48, 4, 320) for _ in range(num_requests)]
    return prompts, outputs


def jsonl_workload(path: str | Path, tokenizer, num_requests: int | None = None) -> tuple[list[list[int]], list[int]]:
    """A workload read from JSONL: one `{"prompt": str | [ids], "max_tokens"|"output_len": int}` per line."""
    prompts, outputs = [], []
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise InvalidRequest(f"--dataset {path}: cannot be read as a JSONL file ({error})") from error
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise InvalidRequest(f"{path}:{number}: not JSON ({error.msg} at column {error.colno})") from error
        prompt = record.get("prompt") if isinstance(record, dict) else None
        wanted = record.get("max_tokens", record.get("output_len")) if isinstance(record, dict) else None
        if not isinstance(wanted, int) or wanted < 1 or not isinstance(prompt, (str, list)) or not prompt:
            raise InvalidRequest(f'{path}:{number}: needs a non-empty "prompt" and a positive "max_tokens"')
        prompts.append(list(prompt) if isinstance(prompt, list) else tokenizer.encode(prompt))
        outputs.append(wanted)
        if num_requests is not None and len(prompts) == num_requests:
            break
    if not prompts:
        raise InvalidRequest(f"{path}: no requests")
    return prompts, outputs
