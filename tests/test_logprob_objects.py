"""Logprobs as vLLM's `Logprob` objects (`.logprob`, `.rank`, `.decoded_token`), which are still floats: the ranks
agree with the whole distribution, the texts with the tokenizer, and code written either way runs; a prompt that
fills the context may still be scored."""

from __future__ import annotations

import pickle

import pytest

from paged_backend.engine import LLM, Logprob, SamplingParams
from paged_backend.errors import InvalidRequest, PromptTooLong
from paged_backend.worker.default_model import TINY_MODEL

PROMPT = [72, 101, 108, 108, 111, 32, 116, 104, 101, 114, 101]


@pytest.fixture(scope="module")
def llm():
    return LLM(TINY_MODEL, device="cpu", num_blocks=64, dtype="float32")


def sampled(llm, **params):
    params = SamplingParams(temperature=1.5, seed=7, max_tokens=8, ignore_eos=True, **params)
    [output] = llm.generate([PROMPT], params)
    return output


def test_a_sampled_tokens_rank_is_its_place_in_the_whole_distribution(llm):
    vocab = len(llm.engine.tokenizer)
    alone = sampled(llm, logprobs=0).outputs[0]
    everything = sampled(llm, logprobs=vocab).outputs[0]
    assert alone.token_ids == everything.token_ids  # asking for logprobs does not change what is sampled
    ranks = []
    for token, entry, full in zip(alone.token_ids, alone.logprobs, everything.logprobs, strict=True):
        [(only, logprob)] = entry.items()
        assert only == token and isinstance(logprob, Logprob) and isinstance(logprob, float)
        assert logprob.logprob == float(logprob) == pytest.approx(full[token], abs=1e-6)
        assert logprob.rank == sum(value >= full[token] for value in full.values())  # vLLM's: at least as likely
        ranks.append(logprob.rank)
        ordered = sorted(full.values(), key=lambda lp: lp.rank)
        assert [lp.rank for lp in ordered] == list(range(1, vocab + 1))
        assert all(a >= b for a, b in zip(ordered, ordered[1:], strict=False))  # rank 1 is the most likely
    assert max(ranks) > 3  # at temperature 1.5 some token was not among the most likely: a rank counted, not read
    few = sampled(llm, logprobs=2).outputs[0]  # the rank read off the top 2, or counted past them: the same
    assert [entry[token].rank for token, entry in zip(few.token_ids, few.logprobs, strict=True)] == ranks


def test_decoded_tokens_and_vllm_style_sums(llm):
    output = sampled(llm, logprobs=3, prompt_logprobs=2)
    tokenizer = llm.engine.tokenizer
    completion = output.outputs[0]
    for entry in completion.logprobs:
        assert len(entry) in (3, 4)  # the sampled token, then the top 3 (it may be one of them)
        assert all(lp.decoded_token == tokenizer.decode([token]) for token, lp in entry.items())
    # the way vLLM's users total a completion: entry[token].logprob
    total = sum(entry[token].logprob for token, entry in zip(completion.token_ids, completion.logprobs, strict=True))
    assert total == pytest.approx(completion.cumulative_logprob, abs=1e-5)
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(PROMPT)
    for token, entry in zip(PROMPT[1:], output.prompt_logprobs[1:], strict=True):
        first = next(iter(entry))
        assert first == token and entry[token].rank >= 1 and entry[token].decoded_token == tokenizer.decode([token])
        assert {lp.rank for lp in entry.values()} >= {1, 2}  # the top 2 alternatives


def test_a_logprob_survives_pickling_and_prints_like_vllms():
    value = pickle.loads(pickle.dumps(Logprob(-0.25, 3, "a")))
    assert (value, value.rank, value.decoded_token) == (-0.25, 3, "a")
    assert repr(value) == "Logprob(logprob=-0.25, rank=3, decoded_token='a')"


def test_a_prompt_of_max_model_len_tokens_may_be_scored_but_not_continued():
    """max_tokens=0 with prompt logprobs scores the prompt alone, so it may fill the context (vLLM refuses only
    prompts longer than max_model_len); one token more, or a token to generate, is refused."""
    llm = LLM(TINY_MODEL, device="cpu", num_blocks=64, dtype="float32", max_model_len=64)
    prompt = [(7 * i) % 200 + 3 for i in range(64)]
    [scored] = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert len(scored.prompt_logprobs) == 64 and scored.outputs[0].token_ids == []
    for too_long, params in ((prompt + [5], SamplingParams(max_tokens=0, prompt_logprobs=0)),
                             (prompt, SamplingParams(max_tokens=1))):  # fmt: skip
        with pytest.raises(PromptTooLong, match="max_model_len is 64"):
            llm.generate([too_long], params)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks - 1


def test_detokenize_false_gives_the_same_tokens_and_no_text(llm):
    """vLLM's `detokenize=False` (RL rollouts read token ids only): the same tokens and logprobs, no text, no
    decoded tokens; stop strings, which match text, need it."""
    texts = sampled(llm, logprobs=2).outputs[0]
    ids = sampled(llm, logprobs=2, detokenize=False).outputs[0]
    assert ids.token_ids == texts.token_ids and ids.text == "" and texts.text
    assert ids.logprobs == texts.logprobs and all(lp.decoded_token is None for e in ids.logprobs for lp in e.values())
    with pytest.raises(InvalidRequest, match="stop needs detokenize=True"):
        SamplingParams(stop=["."], detokenize=False)
