"""Shared pieces of the engine tests: tiny models, HF reference outputs, and engines that must leak no block."""

from __future__ import annotations

import copy
import random
from functools import cache

import pytest
import torch

from paged_backend.engine import LLM
from paged_backend.worker.models import byte_tokenizer, tiny_model

MAX_TOKENS = 12


@cache
def reference_model(arch: str):
    """The tiny model (hidden 64, 2 layers, vocab 256) with plain sdpa attention, built once per arch."""
    model = tiny_model(arch, seed=7)
    model.set_attn_implementation("sdpa")
    return model


def ragged_prompts(count: int = 32, *, seed: int = 0, longest: int = 40, prefix: list[int] | None = None):
    """Token-id prompts of random lengths, avoiding the special ids 253..255."""
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(253) for _ in range(rng.randint(1, longest))] for _ in range(count)]


def hf_greedy(arch: str, prompt: list[int], max_new_tokens: int = MAX_TOKENS) -> list[int]:
    """HF generate, one prompt at a time, no padding, DynamicCache + sdpa: the tokens after the prompt."""
    return list(_hf_greedy(arch, tuple(prompt), max_new_tokens))


@cache
@torch.no_grad()
def _hf_greedy(arch: str, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    ids = torch.tensor([prompt])
    out = reference_model(arch).generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
    )
    return tuple(out[0, len(prompt) :].tolist())


@pytest.fixture(name="make_llm")
def make_llm_fixture():
    """Builds LLMs over copies of the tiny models; after the test every block must be free again."""
    built: list[LLM] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls gain nothing from threads, and lose a lot on a shared busy CPU

    def build(arch: str = "llama", *, model=None, **engine_kwargs) -> LLM:
        """An LLM over a copy of the tiny `arch` model, or of `model` when given."""
        engine_kwargs.setdefault("num_blocks", 256)
        engine_kwargs.setdefault("block_size", 4)
        model = reference_model(arch) if model is None else model
        llm = LLM(copy.deepcopy(model), tokenizer=byte_tokenizer(), **engine_kwargs)
        built.append(llm)
        return llm

    yield build
    torch.set_num_threads(threads)
    for llm in built:
        manager = llm.engine.block_manager
        assert not llm.engine.has_unfinished_requests()
        assert manager.num_free_blocks == manager.num_blocks - 1
        stats = manager.stats()
        assert stats.free_blocks + stats.cached_blocks == stats.total_blocks
