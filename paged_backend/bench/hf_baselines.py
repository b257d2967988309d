"""The HF baselines of `bench throughput`: static-batch `generate` and transformers' own continuous batching
(the manager behind `generate_batch`). Each returns its wall time and the tokens every request produced.

With `eos_ids` empty, EOS is ignored and request i produces exactly `outputs[i]` tokens (static `generate`
suppresses EOS through `min_new_tokens`; continuous batching is given no EOS id). Otherwise request i ends at
the first of `eos_ids` (kept, as the engine keeps it) or after `outputs[i]` tokens.
"""

from __future__ import annotations

import time
from collections.abc import Collection

import torch


def check_exact_lengths(system: str, tokens: list[list[int]], outputs: list[int]) -> None:
    """With EOS ignored, every request must produce exactly its count: anything else is a broken comparison."""
    produced = sum(map(len, tokens))
    if produced != sum(outputs):
        raise RuntimeError(f"{system} produced {produced} tokens, expected {sum(outputs)}")


def until_stop(generated: list[int], cap: int, eos_ids: Collection[int]) -> list[int]:
    """The tokens a request keeps from what `generate` gave its row: at most `cap`, through the first EOS."""
    kept = generated[:cap]
    ends = [i for i, token in enumerate(kept) if token in eos_ids]
    return kept[: ends[0] + 1] if ends else kept


@torch.inference_mode()
def run_static(model, prompts, outputs, batch_size: int, eos_ids: Collection[int] = ()) -> tuple[float, list]:
    """HF generate over arrival-order batches, left padded; a batch runs until its every row has stopped."""
    rows = []
    started = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        batch, longest = prompts[first : first + batch_size], max(outputs[first : first + batch_size])
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
        stopping = {"eos_token_id": sorted(eos_ids)} if eos_ids else {"min_new_tokens": longest}
        generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, do_sample=False,
                                   pad_token_id=0, **stopping)  # fmt: skip
        rows += generated[:, width:].tolist()
    elapsed = time.perf_counter() - started
    return elapsed, [until_stop(row, cap, eos_ids) for row, cap in zip(rows, outputs, strict=True)]


def run_hf_cb(
    model, prompts, outputs, max_batch_tokens: int | None, eos_ids: Collection[int] = ()
) -> tuple[float, list]:
    """HF's own continuous batching: one manager, per-request max_new_tokens."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    eos = sorted(eos_ids) or -1  # -1: no EOS
    generation = GenerationConfig(do_sample=False, eos_token_id=eos, max_new_tokens=max(outputs))
    cb_config = ContinuousBatchingConfig(max_batch_tokens=max_batch_tokens)
    started = time.perf_counter()
    manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=cb_config)
    manager.start()
    for i, (prompt, cap) in enumerate(zip(prompts, outputs, strict=True)):
        manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=cap, eos_token_id=eos)
    tokens = {}
    for _ in prompts:
        result = manager.get_result(timeout=3600)
        tokens[result.request_id] = list(result.generated_tokens)
    manager.stop(block=True)
    elapsed = time.perf_counter() - started
    produced = [tokens[f"r{i}"] for i in range(len(prompts))]
    if not eos_ids:
        check_exact_lengths("HF CB", produced, outputs)
    return elapsed, produced
