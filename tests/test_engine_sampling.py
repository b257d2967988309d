"""Sampling: seeds, parallel samples sharing the prompt, stop conditions, logprobs, top-k/p/min-p, priorities."""

import pytest
from _engine_helpers import make_llm_fixture, ragged_prompts  # noqa: F401

from paged_backend.engine import SamplingParams
from paged_backend.engine.request import Request, Sequence

PROMPT = ragged_prompts(1, seed=5, longest=1)[0] + list(range(60, 80))


def first_output(llm, params, prompt=PROMPT):
    return llm.generate([prompt], params)[0].outputs[0]


def test_seeded_request_gives_same_tokens_alone_and_in_a_busy_batch(make_llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=42, max_tokens=12, ignore_eos=True)
    alone = first_output(make_llm(), seeded).token_ids
    busy = ragged_prompts(12, seed=3)
    params = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)] * 12
    outputs = make_llm(max_num_batched_tokens=32).generate(busy[:6] + [PROMPT] + busy[6:], params[:6] + [seeded] + params[6:])
    assert outputs[6].outputs[0].token_ids == alone
    assert first_output(make_llm(), seeded).token_ids == alone


def test_parallel_samples_store_the_prompt_once(make_llm):
    llm = make_llm()
    engine, manager = llm.engine, llm.engine.block_manager
    prompt = list(range(10, 50))  # 40 tokens = 10 full blocks of 4
    engine.add_request("r", None, SamplingParams(n=8, temperature=1.0, max_tokens=6, ignore_eos=True),
                       prompt_token_ids=prompt)
    engine.step()  # prefill once, fork 8 ways, first token each
    stats = manager.stats()
    assert stats.used_blocks == 10 and stats.shared_blocks == 10
    assert stats.blocks_saved_by_sharing == 7 * 10
    engine.step()  # each sample writes its first token into a block of its own
    assert manager.stats().used_blocks == 10 + 8
    while engine.has_unfinished_requests():
        outputs = engine.step()
    completions = outputs[0].outputs
    assert [c.index for c in completions] == list(range(8))
    assert all(len(c.token_ids) == 6 for c in completions)
    assert len({tuple(c.token_ids) for c in completions}) > 1


def test_parallel_samples_with_partial_last_block_copy_on_write(make_llm):
    llm = make_llm()
    outputs = llm.generate([list(range(10, 48))], SamplingParams(n=4, temperature=0, max_tokens=5, ignore_eos=True))
    greedy = [c.token_ids for c in outputs[0].outputs]
    assert greedy == [greedy[0]] * 4  # greedy samples agree: CoW kept the shared prompt intact
    assert greedy[0] == first_output(llm, SamplingParams(temperature=0, max_tokens=5), list(range(10, 48))).token_ids


def test_stop_token_id_ends_the_sequence(make_llm):
    llm = make_llm()
    greedy = first_output(llm, SamplingParams(temperature=0, max_tokens=8))
    stop_at = greedy.token_ids[2]
    out = first_output(llm, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_at]))
    cut = greedy.token_ids.index(stop_at) + 1
    assert out.token_ids == greedy.token_ids[:cut]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_at)


def test_stop_string_truncates_text(make_llm):
    llm = make_llm()
    greedy = first_output(llm, SamplingParams(temperature=0, max_tokens=12))
    stop = greedy.text[3:5]
    out = first_output(llm, SamplingParams(temperature=0, max_tokens=12, stop=[stop]))
    assert out.text == greedy.text[: greedy.text.find(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)


def test_min_tokens_holds_back_stop_tokens(make_llm):
    llm = make_llm()
    greedy = first_output(llm, SamplingParams(temperature=0, max_tokens=8))
    first = greedy.token_ids[0]
    out = first_output(llm, SamplingParams(temperature=0, max_tokens=8, min_tokens=3, stop_token_ids=[first]))
    assert len(out.token_ids) >= 3 and first not in out.token_ids[:3]


def test_max_tokens_finishes_with_length(make_llm):
    out = first_output(make_llm(), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_logprobs_have_one_entry_per_token_with_top_k(make_llm):
    out = first_output(make_llm(), SamplingParams(temperature=0, max_tokens=6, logprobs=3))
    assert len(out.logprobs) == len(out.token_ids)
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert token in entry and len(entry) == 3  # greedy pick is the top-1, so it is among the 3
        assert max(entry.values()) == entry[token] <= 0


@pytest.mark.parametrize("narrow", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_truncation_to_one_token_equals_greedy(make_llm, narrow):
    llm = make_llm()
    greedy = first_output(llm, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)).token_ids
    sampled = first_output(llm, SamplingParams(temperature=1.5, max_tokens=8, ignore_eos=True, **narrow)).token_ids
    assert sampled == greedy


def test_penalties_change_repetitive_greedy_output(make_llm):
    llm = make_llm()
    plain = first_output(llm, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)).token_ids
    penalized = first_output(
        llm, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=2.0,
                            presence_penalty=2.0, frequency_penalty=2.0)
    ).token_ids
    assert len(set(penalized)) >= len(set(plain))
    assert penalized != plain


def test_priority_policy_serves_smaller_priority_first(make_llm):
    engine = make_llm(max_num_seqs=1, policy="priority").engine
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("later", None, params, prompt_token_ids=[1, 2, 3], priority=5)
    engine.add_request("first", None, params, prompt_token_ids=[4, 5, 6], priority=0)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["first", "later"]


def test_request_metrics_record_latencies(make_llm):
    output = make_llm().generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    metrics = output.metrics
    assert 0 <= metrics.time_to_first_token <= metrics.e2e_latency
    assert len(metrics.inter_token_latencies) == 3


def test_incremental_detokenization_waits_for_whole_characters(make_llm):
    engine = make_llm().engine
    tokenizer = engine.tokenizer
    prompt = tokenizer("say:").input_ids
    seq = Sequence(Request("d", "say:", prompt, SamplingParams()), 0)
    pieces = []
    for token in tokenizer("héllo wörld ✓").input_ids:
        seq.token_ids.append(token)
        pieces.append(engine.output_processor.detokenize(seq))
    assert "".join(pieces) == seq.text == "héllo wörld ✓"
    assert all("\ufffd" not in piece for piece in pieces)


def test_vanishing_temperature_samples_as_greedy(make_llm):
    llm = make_llm()
    prompts = ragged_prompts(4)
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    tiny = llm.generate(prompts, SamplingParams(temperature=1e-300, max_tokens=8, seed=3))
    assert [o.outputs[0].token_ids for o in tiny] == [o.outputs[0].token_ids for o in greedy]


def test_extreme_penalties_keep_the_whole_batch_alive(make_llm):
    llm = make_llm()
    params = [
        SamplingParams(temperature=0.7, repetition_penalty=5e-324, max_tokens=8, seed=1),
        SamplingParams(temperature=0.7, repetition_penalty=1e300, frequency_penalty=2.0, max_tokens=8, seed=2),
        SamplingParams(temperature=0, max_tokens=8),
    ]
    outputs = llm.generate(ragged_prompts(3), params)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [8, 8, 8]


def test_streamed_text_only_grows_when_a_stop_string_matches(make_llm):
    llm = make_llm()
    greedy = first_output(llm, SamplingParams(temperature=0, max_tokens=12))
    stop = greedy.text[3:6]
    engine = llm.engine
    engine.add_request("r", prompt_token_ids=PROMPT, sampling_params=SamplingParams(temperature=0, max_tokens=12,
                                                                                  stop=[stop]))  # fmt: skip
    texts = []
    while engine.has_unfinished_requests():
        texts += [out.outputs[0].text for out in engine.step() if out.request_id == "r"]
    assert texts[-1] == greedy.text[: greedy.text.find(stop)]
    assert all(texts[-1].startswith(text) for text in texts)  # never shows text a match later cuts
