"""Does `torch.compile` (inductor, dynamic shapes) of the model speed up the engine's steps on CPU?

Two ways to put the model under dynamo, each against eager in one run, with greedy tokens checked identical:

- `plain`: `torch.compile(model, dynamic=True)` as it is. The CPU attention kernel is a ctypes call dynamo cannot
  trace, so every layer breaks the graph (and the pieces recompile as shapes change).
- `op`: attention as one opaque torch custom op whose only tensor arguments are this layer's q, k and v. It finds
  the pool and the step's metadata in a per-step context, as vLLM's attention op does, so the pool is not a graph
  input: passing it in (with the cache write as an op that mutates it) made inductor clone the pool and copy it
  back in every layer. The whole forward is then one graph per shape class (the size-1 case specializes).

Workloads: the quick throughput model over 32 requests, and the speculative benchmark's model (hidden 512, 8
layers) at batch 1 (ms/token) and batch 32 (tok/s). Every compiled engine is warmed up on every batch size it is
timed on first, so compile time is reported apart and never inside a timed run.

    OMP_NUM_THREADS=1 python benchmarks/compile_step.py
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from transformers import Cache

from paged_backend.bench.speculative import MODEL as SPEC_MODEL
from paged_backend.bench.speculative import prompts as spec_prompts
from paged_backend.bench.throughput import QUICK_MODEL
from paged_backend.engine import LLM, SamplingParams
from paged_backend.worker import attention
from paged_backend.worker.models import byte_tokenizer, tiny_model

STEP: dict = {}  # the running step's pool and metadata, read by the attention op


@torch.library.custom_op("paged_backend_bench::attend", mutates_args=())
def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int, scaling: float,
           sliding_window: int, softcap: float) -> torch.Tensor:  # fmt: skip
    return attention.attend_packed(STEP["cache"], layer_idx, query, key, value, STEP["metadata"], scaling,
                                   sliding_window or None, softcap or None)  # fmt: skip


@attend.register_fake
def _(query, key, value, layer_idx, scaling, sliding_window, softcap):
    batch, heads, q_len, dim = query.shape
    return query.new_empty((batch, q_len, heads, dim))


class OpHandle:
    def __init__(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
        self.layer_idx, self.key, self.value = layer_idx, key, value

    def attend(self, query, scaling, sliding_window, softcap, attention_mask=None):
        return attend(query, self.key, self.value, self.layer_idx, float(scaling), sliding_window or 0,
                      float(softcap or 0.0))  # fmt: skip


class OpCache(Cache):
    """Holds nothing dynamo would guard on: its handles call the op, which reads `STEP`."""

    def __init__(self) -> None:
        super().__init__(layers=[])

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        handle = OpHandle(layer_idx, key_states, value_states)
        return handle, handle


def engine(model, how: str, **options) -> LLM:
    llm = LLM(model, tokenizer=byte_tokenizer(), device="cpu", **options)
    runner = llm.engine.runner
    if how == "plain":
        runner.model = torch.compile(model, dynamic=True)
    elif how == "op":
        compiled = torch.compile(model, dynamic=True)

        def forward(ids, positions, metadata, rows):
            STEP["cache"], STEP["metadata"] = runner.kv_cache, metadata
            with torch.inference_mode(), attention.paged_attention_enabled(runner.model_configs):
                out = compiled(input_ids=ids, position_ids=positions, past_key_values=OpCache(), use_cache=True,
                               logits_to_keep=torch.tensor(rows, dtype=torch.long))  # fmt: skip
            return out.logits[0].float()

        runner.forward = forward
    return llm


def timed(llm: LLM, prompts, params, repeats: int) -> tuple[float, list]:
    best, tokens = float("inf"), None
    for _ in range(repeats):
        started = time.perf_counter()
        outputs = llm.generate(prompts, params)
        best = min(best, time.perf_counter() - started)
        tokens = [out.outputs[0].token_ids for out in outputs]
    return best, tokens


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per row; the fastest is reported")
    parser.add_argument("--modes", default="eager,plain,op")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rng = random.Random(0)
    quick_prompts = [[rng.randrange(3, 30000) for _ in range(rng.randint(8, 120))] for _ in range(32)]
    quick_params = [SamplingParams(temperature=0, max_tokens=rng.randint(16, 128), ignore_eos=True)
                    for _ in quick_prompts]  # fmt: skip
    spec_batch = spec_prompts("random", 32, 0)
    greedy96 = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    print("| mode | compile s (warm-up) | quick: tok/s | vs eager | batch 1: ms/token | vs eager | batch 32: tok/s "
          "| vs eager | tokens identical |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    base = None
    for how in args.modes.split(","):
        quick = engine(tiny_model("llama", seed=0, vocab_size=32000, max_position_embeddings=2048, **QUICK_MODEL),
                       how, max_num_batched_tokens=512)  # fmt: skip
        spec = engine(tiny_model("llama", seed=0, **SPEC_MODEL), how, block_size=16, num_blocks=1024)
        started = time.perf_counter()
        quick.generate(quick_prompts, quick_params)
        for batch in (spec_batch[:1], spec_batch):
            spec.generate(batch, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        warm = time.perf_counter() - started
        quick_s, quick_tokens = timed(quick, quick_prompts, quick_params, args.repeats)
        one_s, one_tokens = timed(spec, spec_batch[:1], greedy96, args.repeats)
        many_s, many_tokens = timed(spec, spec_batch, greedy96, args.repeats)
        row = (sum(map(len, quick_tokens)) / quick_s, 1000 * one_s / 96, 32 * 96 / many_s)
        if base is None:
            base, reference = row, (quick_tokens, one_tokens, many_tokens)
        same = (quick_tokens, one_tokens, many_tokens) == reference
        print(f"| {how} | {warm:.1f} | {row[0]:.0f} | {row[0] / base[0]:.2f}x | {row[1]:.2f} | {base[1] / row[1]:.2f}x "
              f"| {row[2]:.0f} | {row[2] / base[2]:.2f}x | {same} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
