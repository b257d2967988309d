"""PagedCache under model.generate gives the same tokens (and beam scores) as transformers' DynamicCache.

Full decoding-mode matrix on Llama, padded and not; greedy and beam search on left-padded batches for every
other architecture.
Every attention implementation: sdpa and eager (K/V gathered from the pool) and paged_backend (pool read
directly). The paged_backend run is compared with the model's default attention on a DynamicCache.
"""

from __future__ import annotations

from functools import cache

import pytest
import torch
from _hf_models import ARCHITECTURES, prompts, tiny_model

from paged_backend.hf import PagedCache

NEW_TOKENS = 8
BEAM_SCORES = dict(output_scores=True, return_dict_in_generate=True)
MODES = {
    "greedy": dict(do_sample=False),
    "sample": dict(do_sample=True),
    "sample_n3": dict(do_sample=True, num_return_sequences=3),
    "beam": dict(num_beams=3, do_sample=False, **BEAM_SCORES),
    "beam_n2": dict(num_beams=3, num_return_sequences=2, do_sample=False, **BEAM_SCORES),
    "beam_sample": dict(num_beams=3, do_sample=True, **BEAM_SCORES),
    "chunked_prefill": dict(do_sample=False, prefill_chunk_size=4),
    "prompt_lookup": dict(do_sample=False, prompt_lookup_num_tokens=3),
    "assisted": dict(do_sample=False),  # the assistant model is added by the test
}
SINGLE_ROW_MODES = {"prompt_lookup", "assisted"}  # transformers runs these with batch size 1 only
ATTENTIONS = ("sdpa", "eager", "paged_backend")


@cache
def model_for(arch: str):
    return tiny_model(arch, default_attention(arch))


def default_attention(arch: str) -> str:
    return "eager" if arch == "gemma2" else "sdpa"  # transformers has no sdpa path for Gemma2


def generate(model, attn: str, inputs: dict, kwargs: dict, cache=None):
    model.set_attn_implementation(attn)
    torch.manual_seed(0)
    out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, past_key_values=cache, **kwargs)
    return (out, None) if isinstance(out, torch.Tensor) else (out.sequences, out.sequences_scores)


def assert_same_as_dynamic_cache(arch: str, attn: str, mode: str, padded: bool) -> None:
    model = model_for(arch)
    kwargs = dict(MODES[mode])
    if mode == "assisted":
        kwargs["assistant_model"] = tiny_model(arch, default_attention(arch), seed=1)
    inputs = prompts(padded, rows=1 if mode in SINGLE_ROW_MODES else 2)
    baseline_attn = default_attention(arch) if attn == "paged_backend" else attn
    want_tokens, want_scores = generate(model, baseline_attn, inputs, kwargs)

    cache = PagedCache(model, max_tokens=2048, block_size=4)
    tokens, scores = generate(model, attn, inputs, kwargs, cache)

    assert torch.equal(tokens, want_tokens)
    if want_scores is not None:
        if attn == "paged_backend":  # another attention kernel: equal up to float rounding
            torch.testing.assert_close(scores, want_scores, rtol=0, atol=1e-5)
        else:
            assert torch.equal(scores, want_scores)
    assert cache.get_seq_length() == tokens.shape[1] - 1  # the last token is sampled, never fed back
    cache.reset()
    stats = cache.stats()
    assert stats.used_blocks == 0 and stats.free_blocks == stats.total_blocks


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
@pytest.mark.parametrize("attn", ATTENTIONS)
@pytest.mark.parametrize("mode", MODES)
def test_llama_every_decoding_mode_matches_dynamic_cache(mode, attn, padded):
    assert_same_as_dynamic_cache("llama", attn, mode, padded)


OTHER_CASES = [
    (arch, attn, mode, padded)
    for arch in ARCHITECTURES
    if arch != "llama"
    for attn in ATTENTIONS
    if attn != "sdpa" or default_attention(arch) == "sdpa"
    for mode, padded in (("greedy", True), ("beam", True))  # the unpadded path is architecture-agnostic
]


@pytest.mark.parametrize(("arch", "attn", "mode", "padded"), OTHER_CASES)
def test_architecture_matches_dynamic_cache(arch, attn, mode, padded):
    assert_same_as_dynamic_cache(arch, attn, mode, padded)
