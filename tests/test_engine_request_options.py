"""vLLM's request options in the engine: prompt logprobs, best_of, logit bias, allowed tokens, bad words, typical-p,
the watermark, stop strings kept in the output, and prompt truncation."""

import pytest
import torch
from _engine_helpers import make_llm_fixture, ragged_prompts, reference_model  # noqa: F401
from transformers import TypicalLogitsWarper

from paged_backend.engine import SamplingParams
from paged_backend.engine.sampler import _typical
from paged_backend.engine.watermark import watermark_z_score
from paged_backend.errors import InvalidRequest

PROMPT = list(range(30, 58))  # 28 tokens: 7 full blocks of 4


@torch.no_grad()
def hf_prompt_logprobs(prompt: list[int]) -> torch.Tensor:
    """log_softmax of a full HF forward: row p scores token p + 1."""
    return torch.log_softmax(reference_model("llama")(torch.tensor([prompt])).logits[0].float(), dim=-1)


def assert_prompt_logprobs_match(prompt_logprobs, prompt, top):
    reference = hf_prompt_logprobs(prompt)
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(prompt)
    for position, entry in enumerate(prompt_logprobs[1:], start=1):
        token = prompt[position]
        assert next(iter(entry)) == token  # the prompt's own token comes first
        assert entry[token] == pytest.approx(float(reference[position - 1, token]), abs=1e-4)
        values, ids = reference[position - 1].topk(top)
        for alternative, value in zip(ids.tolist(), values.tolist(), strict=True):
            assert entry[alternative] == pytest.approx(value, abs=1e-4)


@pytest.mark.parametrize("chunked", [False, True])
def test_prompt_logprobs_match_a_full_forward_even_on_a_prefix_cache_hit(make_llm, chunked):
    options = dict(enable_chunked_prefill=True, max_num_batched_tokens=8) if chunked else {}
    llm = make_llm(**options)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    first = llm.generate([PROMPT], params)[0]
    assert_prompt_logprobs_match(first.prompt_logprobs, PROMPT, 3)
    queries, hits = llm.engine.block_manager.prefix_queries, llm.engine.block_manager.prefix_hits
    again = llm.generate([PROMPT], params)[0]  # the prompt's blocks are cached now; logprobs must still be right
    assert_prompt_logprobs_match(again.prompt_logprobs, PROMPT, 3)
    assert llm.engine.block_manager.prefix_hits == hits  # no prefix read for a prompt-logprobs request
    assert llm.engine.block_manager.prefix_queries > queries
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(make_llm):
    llm = make_llm()
    [output] = llm.generate([PROMPT], SamplingParams(max_tokens=0, prompt_logprobs=0))
    completion = output.outputs[0]
    assert completion.token_ids == [] and completion.text == "" and completion.finish_reason == "length"
    assert_prompt_logprobs_match(output.prompt_logprobs, PROMPT, 0)
    [output] = llm.generate([PROMPT], SamplingParams(n=3, best_of=4, max_tokens=0, prompt_logprobs=0))
    assert [(c.index, c.token_ids, c.finish_reason) for c in output.outputs] == [(i, [], "length") for i in range(3)]
    assert_prompt_logprobs_match(output.prompt_logprobs, PROMPT, 0)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks - 1  # block 0 reserved
    with pytest.raises(InvalidRequest, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_prompt_logprobs_survive_preemption(make_llm):
    llm = make_llm(num_blocks=24, max_num_seqs=4)  # 23 usable blocks of 4 for four long requests: preemption
    prompts = [PROMPT, *ragged_prompts(3, seed=9, longest=30)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=1)
    outputs = llm.generate(prompts, params)
    assert llm.engine.stats().num_preemptions > 0
    for prompt, output in zip(prompts, outputs, strict=True):
        assert_prompt_logprobs_match(output.prompt_logprobs, prompt, 1)


def test_best_of_returns_the_n_most_likely_of_its_candidates(make_llm):
    llm = make_llm()
    candidates = llm.generate([PROMPT], SamplingParams(n=5, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True,
                                                        logprobs=0))[0].outputs
    best = llm.generate([PROMPT], SamplingParams(n=2, best_of=5, temperature=1.0, seed=3, max_tokens=6,
                                                  ignore_eos=True))[0].outputs
    ranked = sorted(candidates, key=lambda c: c.cumulative_logprob, reverse=True)
    assert [c.index for c in best] == [0, 1]
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked[:2]]
    for completion in candidates:  # the cumulative logprob is the sum of the sampled tokens' logprobs
        total = sum(entry[token] for token, entry in zip(completion.token_ids, completion.logprobs, strict=True))
        assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)
    with pytest.raises(InvalidRequest, match="best_of"):
        SamplingParams(n=3, best_of=2)


def test_logit_bias_and_allowed_token_ids_steer_greedy_decoding(make_llm):
    llm = make_llm()
    forced = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5, logit_bias={65: 100}))[0]
    assert forced.outputs[0].token_ids == [65] * 5
    allowed = [70, 71, 72]
    limited = llm.generate([PROMPT], SamplingParams(temperature=0.8, seed=1, max_tokens=20, ignore_eos=True,
                                                     allowed_token_ids=allowed))[0]
    assert set(limited.outputs[0].token_ids) <= set(allowed)
    with pytest.raises(InvalidRequest, match="allowed_token_ids"):
        llm.generate([PROMPT], SamplingParams(allowed_token_ids=[999]))


def test_bad_words_never_appear(make_llm):
    llm = make_llm()
    letters = list(range(ord("a"), ord("z") + 1))  # greedy over lowercase letters only: readable text
    params = dict(temperature=0, max_tokens=24, ignore_eos=True, allowed_token_ids=letters)
    text = llm.generate([PROMPT], SamplingParams(**params))[0].outputs[0].text
    word = text[2:5]  # three letters greedy decoding writes: a three-token bad word
    assert len(llm.engine.tokenizer(word, add_special_tokens=False).input_ids) == 3
    banned = llm.generate([PROMPT], SamplingParams(**params, bad_words=[word]))[0].outputs[0].text
    assert word not in banned and banned[:4] == text[:4]  # only the word's last token was refused


def test_rules_that_leave_no_token_are_refused_up_front_or_yield_to_allowed_token_ids(make_llm):
    llm = make_llm()
    eos = llm.engine.tokenizer.eos_token_id
    with pytest.raises(InvalidRequest, match="min_tokens=2 cannot be met"):
        llm.generate([PROMPT], SamplingParams(max_tokens=4, min_tokens=2, allowed_token_ids=[eos]))
    with pytest.raises(InvalidRequest, match="min_tokens=2 cannot be met"):
        llm.generate([PROMPT], SamplingParams(max_tokens=4, min_tokens=2, allowed_token_ids=[97], stop_token_ids=[97]))
    with pytest.raises(InvalidRequest, match="bad_words ban every token"):
        llm.generate([PROMPT], SamplingParams(max_tokens=4, allowed_token_ids=[97], bad_words=["a"]))
    with pytest.raises(InvalidRequest, match="logprobs=60000 asks for more alternatives"):
        llm.generate([PROMPT], SamplingParams(max_tokens=4, logprobs=60000))
    # "aa" bans a second "a" only once one is written: that row then keeps allowed_token_ids, and its neighbour in
    # the same steps is not failed with it
    stuck = SamplingParams(temperature=1.0, seed=0, max_tokens=4, ignore_eos=True, allowed_token_ids=[97],
                           bad_words=["aa"])  # fmt: skip
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outputs = llm.generate([PROMPT, PROMPT], [stuck, plain])
    assert outputs[0].outputs[0].token_ids == [97] * 4
    assert outputs[1].outputs[0].token_ids == llm.generate([PROMPT], plain)[0].outputs[0].token_ids
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks - 1


def test_typical_p_matches_transformers_warper_and_leaves_greedy_alone(make_llm):
    logits = torch.randn(3, 256, generator=torch.Generator().manual_seed(0)) * 3
    for mass in (0.2, 0.6, 0.95):
        ours = _typical(logits.clone(), torch.full((3,), mass))
        theirs = TypicalLogitsWarper(mass)(None, logits.clone())
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    llm = make_llm()
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    typical = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, typical_p=0.2)
    assert llm.generate([PROMPT], typical)[0].outputs[0].token_ids == llm.generate([PROMPT], greedy)[0].outputs[0].token_ids
    sampled = SamplingParams(temperature=1.0, seed=4, max_tokens=8, ignore_eos=True, typical_p=0.5)
    assert llm.generate([PROMPT], sampled)[0].outputs[0].token_ids == llm.generate([PROMPT], sampled)[0].outputs[0].token_ids


def test_watermarked_text_is_detected_and_plain_text_is_not(make_llm):
    llm = make_llm(max_model_len=256, num_blocks=300)
    prompts = ragged_prompts(4, seed=2, longest=8)
    plain = SamplingParams(temperature=1.0, seed=11, max_tokens=100, ignore_eos=True)
    marked = SamplingParams(temperature=1.0, seed=11, max_tokens=100, ignore_eos=True, watermark=True)
    for out in llm.generate(prompts, marked):
        assert watermark_z_score(out.outputs[0].token_ids, 256) > 4
    for out in llm.generate(prompts, plain):
        assert abs(watermark_z_score(out.outputs[0].token_ids, 256)) < 2.5


def test_stop_string_can_stay_in_the_output_and_prompts_can_be_truncated(make_llm):
    llm = make_llm()
    text = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0].text
    stop = text[4:6]
    cut = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, stop=stop))[0].outputs[0]
    kept = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, stop=stop,
                                                  include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == cut.text + stop and kept.text.endswith(stop)
    truncated = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, truncate_prompt_tokens=10))[0]
    assert truncated.prompt_token_ids == PROMPT[-10:]
    assert truncated.outputs[0].token_ids == llm.generate([PROMPT[-10:]], SamplingParams(
        temperature=0, max_tokens=4))[0].outputs[0].token_ids


def test_extreme_temperature_penalty_and_top_k_sample_without_nan(make_llm):
    # Found by schemathesis through the TGI face: a temperature past float32's range became inf and -inf / inf NaN.
    llm = make_llm()
    params = SamplingParams(max_tokens=4, seed=1, repetition_penalty=3.37e307, temperature=1.03e285, top_p=0.1267,
                            top_k=2**70, ignore_eos=True)
    [output] = llm.generate([PROMPT], params)
    assert len(output.outputs[0].token_ids) == 4


def test_prompts_in_each_of_vllms_forms_generate_the_same_tokens(make_llm):
    llm = make_llm()
    text = "the same prompt"
    ids = llm.engine.tokenizer(text).input_ids
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    forms = [text, ids, {"prompt": text}, {"prompt_token_ids": ids}]
    outputs = llm.generate(forms, greedy)
    assert all(out.prompt_token_ids == ids for out in outputs)
    assert len({tuple(out.outputs[0].token_ids) for out in outputs}) == 1
    [single] = llm.generate({"prompt_token_ids": ids}, greedy)  # one prompt, not in a list
    assert single.outputs[0].token_ids == outputs[0].outputs[0].token_ids


@pytest.mark.parametrize(
    "prompt, message",
    [
        ({"text": "hi"}, "'prompt' .*'prompt_token_ids'"),
        ({}, "'prompt' .*'prompt_token_ids'"),
        ({"prompt_token_ids": "1 2"}, "list of token ids"),
        ({"prompt": 5}, "a prompt is text"),
    ],
)
def test_a_malformed_prompt_dict_names_the_keys_to_use(make_llm, prompt, message):
    llm = make_llm()
    with pytest.raises(InvalidRequest, match=message):
        llm.generate([prompt], SamplingParams(max_tokens=2))
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks - 1


def test_num_cached_tokens_counts_the_prefix_cache_hit_of_the_first_admission(make_llm):
    llm = make_llm(enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=2)
    cold = llm.generate([PROMPT], params)[0]
    warm = llm.generate([PROMPT], params)[0]
    assert cold.num_cached_tokens == 0
    # 28 tokens = 7 full blocks of 4; the last block is recomputed so the step has a token to sample from
    assert warm.num_cached_tokens == 24
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
