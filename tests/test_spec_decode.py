"""Speculative decoding in the engine: greedy outputs token-identical to plain decoding (n-gram and draft model)
under preemption, chunked prefill, prefix hits, n > 1, stop strings and max_tokens cut-offs; rejection sampling
that follows the target distribution (chi-square); per-request fallback; both pools leak no block."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from scipy.stats import chisquare

from paged_backend.bench.speculative import truncated
from paged_backend.config.speculative import SpeculativeConfig
from paged_backend.engine import SamplingParams
from paged_backend.errors import InvalidRequest
from paged_backend.spec_decode.ngram import propose_ngram
from paged_backend.spec_decode.rejection import verify_sampled
from tests._engine_helpers import make_llm_fixture, reference_model  # noqa: F401

# A cyclic prompt gives prompt lookup something to find; random ones mostly do not.
PROMPTS = [[7, 8, 9, 10, 11] * 5] + [
    [random.Random(seed).randrange(253) for _ in range(random.Random(seed).randint(3, 40))] for seed in range(9)
]
PREFIX = [40, 41, 42, 43, 44, 45, 46, 47]
TINY_POOL = dict(num_blocks=40, block_size=4, max_num_batched_tokens=24, max_num_seqs=8)  # preempts, chunks


def requests():
    """Mixed: plain greedy, n=2, a stop string, short max_tokens (cut mid-proposal), shared-prefix prompts."""
    prompts = PROMPTS + [PREFIX + p[:5] for p in PROMPTS[:3]]
    params = []
    for i, _ in enumerate(prompts):
        options = dict(temperature=0, max_tokens=[20, 3, 11, 1][i % 4], ignore_eos=True)
        if i % 5 == 1:
            options["n"] = 2
        if i % 5 == 2:
            options["stop"] = ["\x0b"]  # byte 11 of the cyclic prompt: a likely stop
        params.append(SamplingParams(**options))
    return prompts, params


def generate(llm):
    prompts, params = requests()
    outputs = llm.generate(prompts, params)
    return [[(c.token_ids, c.text, c.finish_reason) for c in out.outputs] for out in outputs]


@pytest.fixture(scope="module")
def plain_outputs():
    from paged_backend.engine import LLM
    from paged_backend.worker.models import byte_tokenizer

    torch.set_num_threads(1)
    llm = LLM(copy.deepcopy(reference_model("llama")), tokenizer=byte_tokenizer(), **TINY_POOL)
    return generate(llm)


def draft_pool_free(llm) -> bool:
    manager = llm.engine.speculator.draft.block_manager
    return manager.num_free_blocks == manager.num_blocks - 1


@pytest.mark.parametrize("method", ["ngram", "draft_model", "ngram-swap"])
def test_greedy_tokens_identical_to_plain_decoding(make_llm, plain_outputs, method):
    spec = {"num_speculative_tokens": 3}
    if method.startswith("ngram"):
        spec.update(method="ngram", prompt_lookup_max=3, prompt_lookup_min=1)
    else:
        spec["model"] = truncated(reference_model("llama"), 1)
    swap = dict(swap_space=0.001, preemption_mode="swap") if method == "ngram-swap" else {}
    llm = make_llm(speculative_config=spec, **TINY_POOL, **swap)
    assert generate(llm) == plain_outputs
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.num_split_prefills > 0 and stats.prefix_cache_hits > 0
    assert stats.spec_decode_num_draft_tokens > 0 and 0 < stats.spec_decode_num_accepted_tokens
    assert sum(stats.spec_decode_num_accepted_tokens_per_pos) == stats.spec_decode_num_accepted_tokens
    if method == "draft_model":
        assert draft_pool_free(llm)  # the fixture checks the target pool


def test_draft_equal_to_target_accepts_everything(make_llm):
    llm = make_llm(speculative_config={"model": copy.deepcopy(reference_model("llama")), "num_speculative_tokens": 4})
    llm.generate(PROMPTS[:4], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    stats = llm.engine.stats()
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
    assert draft_pool_free(llm)


def test_drafts_follow_acceptance_a_sequence_that_never_agrees_only_probes(make_llm):
    """A draft that always proposes token 0 (its final norm zeroed: all-zero logits), which the target never picks:
    after the first k-token draft is rejected outright, the sequence backs off and then probes one token at a time."""
    draft = truncated(reference_model("llama"), 1)
    torch.nn.init.zeros_(draft.model.norm.weight)
    llm = make_llm(speculative_config={"model": draft, "num_speculative_tokens": 4})
    out = llm.generate(PROMPTS[1:2], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    assert 0 not in out.token_ids
    stats = llm.engine.stats()
    assert stats.spec_decode_num_accepted_tokens == 0
    # Drafts at decode steps 1, 3, 7, 15, 31 (waits 1, 3, 7, 15 between): one of 4 tokens, then 1-token probes.
    assert stats.spec_decode_num_drafts == 5
    assert stats.spec_decode_num_draft_tokens == 4 + 4
    assert draft_pool_free(llm)


def test_requests_that_cannot_speculate_fall_back_alone(make_llm, plain_outputs):
    """A penalty depends on the tokens drawn before it: that request decodes plainly; the others (one asking for
    logprobs, which speculation reports row by row as plain decoding does) still speculate."""
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = make_llm(speculative_config=spec)
    cyclic = PROMPTS[0]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outputs = llm.generate(
        [cyclic, cyclic, cyclic],
        [greedy, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1),
         SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3)],
    )  # fmt: skip
    plain = make_llm().generate([cyclic] * 3, [greedy, greedy, SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3)])  # fmt: skip
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
    plain_logprobs = make_llm().generate([cyclic], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                                  logprobs=1))[0].outputs[0]  # fmt: skip
    spec_logprobs = outputs[1].outputs[0]
    for spec_row, plain_row in zip(spec_logprobs.logprobs, plain_logprobs.logprobs, strict=True):
        assert spec_row.keys() == plain_row.keys()
        assert all(spec_row[token] == pytest.approx(plain_row[token], abs=1e-4) for token in spec_row)
    assert spec_logprobs.cumulative_logprob == pytest.approx(plain_logprobs.cumulative_logprob, abs=1e-3)
    assert llm.engine.stats().spec_decode_num_drafts > 0


def test_disable_by_batch_size_turns_speculation_off_for_big_steps(make_llm):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 2}
    llm = make_llm(speculative_config=spec)
    llm.generate([PROMPTS[0]] * 2, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert llm.engine.stats().spec_decode_num_drafts == 0
    llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert llm.engine.stats().spec_decode_num_drafts > 0


def test_seeded_sampling_is_reproducible(make_llm):
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=5, ignore_eos=True)
    first = make_llm(speculative_config=spec).generate(PROMPTS[:3], params)
    second = make_llm(speculative_config=spec).generate(PROMPTS[:3], params)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]


def test_rejection_sampling_follows_the_target_distribution():
    """Over a 5-token vocabulary: the first emitted token follows p0 whatever the draft, and the second one, given
    the first draft was accepted, follows p1 (chi-square, many seeded draws)."""
    probs = torch.tensor(
        [[0.1, 0.4, 0.2, 0.25, 0.05], [0.3, 0.05, 0.05, 0.2, 0.4], [0.2, 0.2, 0.2, 0.2, 0.2]], dtype=torch.float64
    )
    draft = [1, 3]
    generator = torch.Generator().manual_seed(0)
    first, second = torch.zeros(5), torch.zeros(5)
    draws = 20000
    for _ in range(draws):
        tokens = verify_sampled(probs, draft, generator)
        first[tokens[0]] += 1
        if tokens[0] == draft[0]:
            second[tokens[1]] += 1
    for counts, p in ((first, probs[0]), (second, probs[1])):
        result = chisquare(counts.numpy(), (p * counts.sum()).numpy())
        assert result.pvalue > 0.001, (counts, p)


def test_ngram_lookup_and_config_names():
    assert propose_ngram([1, 2, 3, 1, 2, 3, 1, 2], k=3, min_n=1, max_n=2) == [3, 1, 2]
    assert propose_ngram([1, 2, 3], k=2, min_n=2, max_n=2) == []
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_max=5, prompt_lookup_min=2)
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (2, 5)
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig(num_speculative_tokens=2)


def test_sliding_window_models_are_refused_unless_one_table(make_llm):
    """Windowed layers free blocks behind the window, which a rollback could need again: refused with the flag
    that keeps whole tables, under which speculation runs and matches plain decoding."""
    from paged_backend.worker.models import tiny_model

    windowed = tiny_model("mistral", seed=1)
    windowed.config.sliding_window = 8
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(InvalidRequest, match="disable_hybrid_kv_cache_manager"):
        make_llm(model=windowed, speculative_config=spec)
    llm = make_llm(model=windowed, speculative_config=spec, disable_hybrid_kv_cache_manager=True)
    plain = make_llm(model=windowed, disable_hybrid_kv_cache_manager=True)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], params)] == [
        o.outputs[0].token_ids for o in plain.generate(PROMPTS[:3], params)
    ]


def test_draft_model_from_a_directory_and_refusals(make_llm, tmp_path):
    """`{"model": PATH}` loads the draft; another vocabulary is refused with what to change."""
    from paged_backend.worker.models import byte_tokenizer, tiny_model

    truncated(reference_model("llama"), 1).save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    llm = make_llm(speculative_config={"model": str(tmp_path), "num_speculative_tokens": 2})
    plain = make_llm()
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params)] == [
        o.outputs[0].token_ids for o in plain.generate(PROMPTS[:2], params)
    ]
    assert llm.engine.stats().spec_decode_num_drafts > 0 and draft_pool_free(llm)
    with pytest.raises(InvalidRequest, match="vocabulary"):
        make_llm(speculative_config={"model": tiny_model("llama", vocab_size=320), "num_speculative_tokens": 2})


def test_structured_outputs_speculate_with_the_grammar_rolled_back(make_llm):
    """Each verified row is masked by the grammar state its draft prefix leads to; the matcher rolls back after, so
    greedy output is plain decoding's and sampled output still matches the grammar."""
    import re

    from paged_backend.structured import StructuredOutputsParams

    regex = r"(ab[0-9] ){2,9}end"
    constrained = dict(structured_outputs=StructuredOutputsParams(regex=regex), max_tokens=48)
    greedy = SamplingParams(temperature=0, **constrained)
    sampled = SamplingParams(temperature=1.0, seed=3, **constrained)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = make_llm(speculative_config=spec)
    outputs = llm.generate(PROMPTS[:3] * 2, [greedy] * 3 + [sampled] * 3)
    plain = make_llm().generate(PROMPTS[:3], greedy)
    assert [o.outputs[0].text for o in outputs[:3]] == [o.outputs[0].text for o in plain]
    assert all(re.fullmatch(regex, o.outputs[0].text) for o in outputs), [o.outputs[0].text for o in outputs]
    assert llm.engine.stats().spec_decode_num_accepted_tokens > 0


def test_sampled_engine_outputs_follow_the_target_distribution(make_llm):
    """End to end through the engine: top_k=4 makes a 4-token vocabulary. The draft (the target itself, proposing its
    argmax) is accepted with its probability and otherwise replaced from the residual, so given the first sampled
    token, the second follows the target model's distribution (chi-square over 2400 seeds)."""
    prompt = PROMPTS[3]
    draft = copy.deepcopy(reference_model("llama"))
    llm = make_llm(speculative_config={"model": draft, "num_speculative_tokens": 2}, num_blocks=1024,
                   max_num_seqs=256, max_num_batched_tokens=4096)  # fmt: skip
    draws = 2400
    outputs = llm.generate([prompt] * draws, [SamplingParams(temperature=1.0, top_k=4, seed=seed, max_tokens=3,
                                                             ignore_eos=True) for seed in range(draws)])  # fmt: skip
    assert llm.engine.stats().spec_decode_num_drafts >= draws // 2
    pairs = [tuple(o.outputs[0].token_ids) for o in outputs]
    first = max(set(p[0] for p in pairs), key=[p[0] for p in pairs].count)
    seconds = [p[1] for p in pairs if p[0] == first]
    with torch.no_grad():
        logits = reference_model("llama")(torch.tensor([prompt + [first]])).logits[0, -1].double()
    top = logits.topk(4)
    expected = torch.softmax(top.values, dim=-1) * len(seconds)
    observed = [seconds.count(token) for token in top.indices.tolist()]
    assert sum(observed) == len(seconds)  # nothing outside the top 4
    assert chisquare(observed, expected.numpy()).pvalue > 0.001, (observed, expected)
    stats = llm.engine.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens  # both paths ran
