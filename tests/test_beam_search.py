"""Beam search in the engine: HF's beams where the two searches agree, vLLM's rules where they differ (end tokens and
the length penalty), beams sharing blocks, preemption, and vLLM's offline API (`LLM.beam_search`)."""

from __future__ import annotations

import copy

import pytest
import torch
from _engine_helpers import hf_greedy, make_llm_fixture, ragged_prompts, reference_model  # noqa: F401

from paged_backend import BeamSearchParams, InvalidRequest, SamplingParams


def beams(width: int, max_tokens: int = 8, **kwargs) -> SamplingParams:
    return SamplingParams(n=width, use_beam_search=True, max_tokens=max_tokens, **kwargs)


def token_prompts(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": prompt} for prompt in prompts]


@torch.no_grad()
def hf_beams(prompt: list[int], width: int, max_tokens: int) -> tuple[list[list[int]], list[float]]:
    """transformers' beam search with no end token: each beam's tokens and cumulative logprob, best first."""
    model = copy.deepcopy(reference_model("llama"))
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, num_beams=width,
                         num_return_sequences=width, do_sample=False, early_stopping=False, output_scores=True,
                         return_dict_in_generate=True)  # fmt: skip
    # its score is the cumulative logprob over the generated length (length_penalty 1)
    return [row[len(prompt) :].tolist() for row in out.sequences], (out.sequences_scores * max_tokens).tolist()


@torch.no_grad()
def vllm_beams(prompt: list[int], width: int, max_tokens: int, ends: set[int], length_penalty: float = 1.0):
    """vLLM's beam search written out over full forwards of the reference model: (tokens, cumulative) best first."""
    model = reference_model("llama")
    live, done = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        going = []
        for tokens, cumulative in live:
            logprobs = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1].float(), dim=-1)
            values, ids = logprobs.topk(2 * width)
            for token, value in zip(ids.tolist(), values.tolist(), strict=True):
                (done if token in ends else going).append((tokens + [token], cumulative + value))
        live = sorted(going, key=lambda beam: beam[1], reverse=True)[:width]
    done += live

    def score(beam):
        tokens, cumulative = beam
        return cumulative / (len(tokens) - (tokens[-1] in ends)) ** length_penalty

    return [(tokens[len(prompt) :], cumulative) for tokens, cumulative in sorted(done, key=score, reverse=True)[:width]]


@pytest.mark.parametrize("width", [2, 4])
def test_beams_equal_transformers_beam_search(width, make_llm):
    """With no end token the two searches are the same: each step keeps the `width` best of every beam's
    continuations. A greedy request in the same batch keeps its own tokens."""
    prompts = ragged_prompts(3, seed=width)
    llm = make_llm("llama")
    params = [beams(width, ignore_eos=True)] * len(prompts) + [SamplingParams(temperature=0, max_tokens=8,
                                                                              ignore_eos=True)]  # fmt: skip
    *outputs, greedy = llm.generate(token_prompts(prompts + [prompts[0]]), params)
    for prompt, output in zip(prompts, outputs, strict=True):
        expected, cumulative = hf_beams(prompt, width, 8)
        assert [completion.token_ids for completion in output.outputs] == expected
        assert [completion.cumulative_logprob for completion in output.outputs] == pytest.approx(cumulative, abs=1e-4)
        assert [completion.index for completion in output.outputs] == list(range(width))
        assert {completion.finish_reason for completion in output.outputs} == {"length"}
    assert greedy.outputs[0].token_ids == hf_greedy("llama", prompts[0], 8)


def test_one_beam_is_greedy(make_llm):
    prompts = ragged_prompts(4, seed=5)
    llm = make_llm("llama")
    outputs = llm.generate(token_prompts(prompts), beams(1, max_tokens=10, ignore_eos=True))
    assert [output.outputs[0].token_ids for output in outputs] == [hf_greedy("llama", p, 10) for p in prompts]


@pytest.mark.parametrize("length_penalty", [1.0, 0.3, 2.0])
def test_end_tokens_finish_beams_ranked_as_vllm_ranks_them(length_penalty, make_llm):
    """A candidate that ends (here a stop token the beams often propose) becomes a finished beam and is not counted
    in the score's length; finished and live beams are ranked together at the end by vLLM's score."""
    prompt = ragged_prompts(1, seed=11)[0]
    llm = make_llm("llama")
    free_run = llm.generate(token_prompts([prompt]), beams(3, ignore_eos=True))[0]
    stop = free_run.outputs[0].token_ids[2]  # proposed within the first steps
    [output] = llm.generate(token_prompts([prompt]), beams(3, ignore_eos=True, stop_token_ids=[stop],
                                                           length_penalty=length_penalty))  # fmt: skip
    expected = vllm_beams(prompt, 3, 8, {stop}, length_penalty)
    assert [completion.token_ids for completion in output.outputs] == [tokens for tokens, _ in expected]
    assert [c.cumulative_logprob for c in output.outputs] == pytest.approx([c for _, c in expected], abs=1e-4)
    tokenizer = llm.get_tokenizer()
    for completion in output.outputs:
        ended = completion.token_ids[-1] == stop
        assert (completion.finish_reason, completion.stop_reason) == (("stop", stop) if ended else ("length", None))
        shown = completion.token_ids[:-1] if ended else completion.token_ids  # the stop token is not in the text
        assert completion.text == tokenizer.decode(shown, skip_special_tokens=True)
    assert any(completion.finish_reason == "stop" for completion in output.outputs) or length_penalty == 2.0


def test_beams_share_their_blocks_while_they_run(make_llm):
    """Beams fork: the prompt's blocks are held once by every beam (refcounts), not copied per beam."""
    llm = make_llm("llama", block_size=4)
    engine, prompt = llm.engine, ragged_prompts(1, seed=2, longest=40)[0] + list(range(40))
    engine.add_request("b", {"prompt_token_ids": prompt}, beams(4, max_tokens=6, ignore_eos=True))
    most_shared = 0
    while engine.has_unfinished_requests():
        engine.step()
        most_shared = max(most_shared, max(block.ref_count for block in engine.block_manager.blocks))
    assert most_shared == 4


@pytest.mark.parametrize(("mode", "num_blocks"), [("recompute", 24), ("swap", 16), ("recompute", 12)])
def test_preempted_beams_give_the_same_beams(mode, num_blocks, make_llm):
    """A pool too small for every beam at once preempts some of them; the others wait for them before choosing. At
    12 blocks no request's four beams fit together: beams that proposed give their blocks up until the last one has
    proposed too (a step that scheduled nothing would otherwise come back forever)."""
    prompts = ragged_prompts(4, seed=9, longest=40)
    params = beams(4, max_tokens=12, ignore_eos=True)
    expected = make_llm("llama").generate(token_prompts(prompts), params)
    options = {"swap_space": 0.01} if mode == "swap" else {"preemption_mode": "recompute"}
    tight = make_llm("llama", num_blocks=num_blocks, watermark=0.0, **options)
    outputs = tight.generate(token_prompts(prompts), params)
    assert tight.engine.scheduler.preemption_mode == mode
    assert tight.engine.scheduler.num_preemptions > 0
    assert [[c.token_ids for c in o.outputs] for o in outputs] == [[c.token_ids for c in o.outputs] for o in expected]
    assert tight.engine.block_manager.stats().cpu_blocks_used == 0


def test_logprobs_of_beams_hold_each_chosen_token_and_the_top_k(make_llm):
    llm = make_llm("llama")
    [output] = llm.generate(token_prompts(ragged_prompts(1, seed=4)), beams(3, ignore_eos=True, logprobs=2))
    for completion in output.outputs:
        assert len(completion.logprobs) == len(completion.token_ids)
        chosen = [entry[token] for entry, token in zip(completion.logprobs, completion.token_ids, strict=True)]
        assert sum(chosen) == pytest.approx(completion.cumulative_logprob, abs=1e-5)
        for entry, token in zip(completion.logprobs, completion.token_ids, strict=True):
            ranked = sorted(entry.items(), key=lambda item: item[1], reverse=True)
            assert len(entry) in (2, 3)  # the top 2, and the chosen token when it is not among them
            assert [logprob.rank for _, logprob in ranked[:2]] == [1, 2]
            if len(entry) == 2:
                assert entry[token].rank == 1 + [t for t, _ in ranked].index(token)
            else:  # one of the 2 x width candidates below the top 2
                assert 3 <= entry[token].rank <= 6


def test_llm_beam_search_answers_in_vllms_shape(make_llm):
    llm = make_llm("llama")
    prompt = ragged_prompts(1, seed=6)[0]
    [result] = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=3, max_tokens=5,
                                                                                 ignore_eos=True))  # fmt: skip
    expected = llm.generate(token_prompts([prompt]), beams(3, max_tokens=5, ignore_eos=True))[0]
    assert len(result.sequences) == 3
    tokenizer = llm.get_tokenizer()
    for sequence, completion in zip(result.sequences, expected.outputs, strict=True):
        assert sequence.tokens == prompt + completion.token_ids
        assert sequence.text == tokenizer.decode(sequence.tokens)
        assert sequence.cum_logprob == pytest.approx(completion.cumulative_logprob)
        assert len(sequence.logprobs) == 5 and all(len(entry) == 6 for entry in sequence.logprobs)  # 2 x width
    with pytest.raises(InvalidRequest, match="BeamSearchParams"):
        llm.beam_search(["x"], SamplingParams())


@pytest.mark.parametrize(
    ("fields", "named"),
    [({"top_p": 0.5}, "top_p"), ({"stop": ["x"]}, "stop"), ({"best_of": 5}, "best_of"),
     ({"repetition_penalty": 1.2}, "repetition_penalty"), ({"min_tokens": 2}, "min_tokens"),
     ({"length_penalty": 2000.0}, "length_penalty"), ({"length_penalty": -2000.0}, "length_penalty")],
)  # fmt: skip
def test_sampling_fields_are_refused_with_beam_search(fields, named):
    with pytest.raises(InvalidRequest, match=named):
        beams(3, **fields)


def test_temperature_and_seed_are_taken_and_change_nothing(make_llm):
    llm = make_llm("llama")
    prompts = token_prompts(ragged_prompts(2, seed=8))
    plain = llm.generate(prompts, beams(2, ignore_eos=True))
    warm = llm.generate(prompts, beams(2, ignore_eos=True, temperature=0.8, seed=3))
    assert [[c.token_ids for c in o.outputs] for o in plain] == [[c.token_ids for c in o.outputs] for o in warm]


def test_an_aborted_search_frees_every_beam(make_llm):
    """Beams running, set aside or waiting: an abort frees them all (the fixture checks the pool after the test)."""
    llm = make_llm("llama", num_blocks=12, watermark=0.0, preemption_mode="recompute")
    engine = llm.engine
    for index, prompt in enumerate(ragged_prompts(3, seed=9, longest=40)):
        engine.add_request(str(index), {"prompt_token_ids": prompt}, beams(4, max_tokens=12, ignore_eos=True))
    for _ in range(12):
        engine.step()
    assert engine.scheduler.set_aside or engine.scheduler.waiting
    for index in range(3):
        engine.abort_request(str(index))
    assert not engine.scheduler.set_aside and not engine.scheduler.running and not engine.scheduler.waiting


def test_a_width_past_half_the_vocabulary_takes_every_token_as_a_candidate(make_llm):
    """2 x 200 candidates from a 256-token vocabulary: all of them, not a failed step."""
    llm = make_llm("llama", max_num_seqs=256)
    [output] = llm.generate(token_prompts(ragged_prompts(1, seed=1)), beams(200, max_tokens=2, ignore_eos=True))
    assert len(output.outputs) == 200 and len({tuple(c.token_ids) for c in output.outputs}) == 200
