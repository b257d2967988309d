"""Bad input fails at once with a named error saying what is wrong, and the engine keeps serving."""

import pytest
from _engine_helpers import make_llm_fixture  # noqa: F401

from paged_backend.config import EngineConfig
from paged_backend.engine import Engine, SamplingParams
from paged_backend.errors import InvalidRequest, PromptTooLong
from paged_backend.worker.models import load_model

GREEDY = SamplingParams(temperature=0, max_tokens=4)


def still_serves(llm):
    out = llm.generate([[1, 2, 3]], GREEDY)[0]
    assert out.finished and len(out.outputs[0].token_ids) == 4


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", -0.5), ("top_p", 1.5), ("top_p", 0.0), ("n", 0), ("max_tokens", 0), ("top_k", -2),
     ("min_p", 2.0), ("repetition_penalty", 0.0), ("presence_penalty", 3.0), ("min_tokens", 99), ("logprobs", -1),
     ("stop", [""])],
)
def test_invalid_sampling_values_name_the_field(field, value):
    with pytest.raises(InvalidRequest, match=field):
        SamplingParams(**{field: value})


def test_empty_prompt_is_rejected_and_engine_keeps_serving(make_llm):
    llm = make_llm()
    with pytest.raises(InvalidRequest, match="empty"):
        llm.engine.add_request("a", "", GREEDY)
    with pytest.raises(InvalidRequest, match="empty"):
        llm.generate([[]], GREEDY)
    still_serves(llm)


def test_prompt_longer_than_max_model_len_is_rejected(make_llm):
    llm = make_llm(max_model_len=32)
    with pytest.raises(PromptTooLong, match="max_model_len is 32"):
        llm.generate([list(range(40))], GREEDY)
    still_serves(llm)


def test_max_model_len_caps_generation(make_llm):
    out = make_llm(max_model_len=10).generate([list(range(8))], SamplingParams(temperature=0, max_tokens=50))[0]
    assert len(out.outputs[0].token_ids) == 2 and out.outputs[0].finish_reason == "length"


def test_max_model_len_never_exceeds_the_pool(make_llm):
    llm = make_llm(num_blocks=9, block_size=4, watermark=0.0)
    assert llm.engine.max_model_len == 32
    with pytest.raises(PromptTooLong, match="KV pool"):
        llm.generate([list(range(40))], GREEDY)


def test_bad_request_in_a_batch_queues_nothing(make_llm):
    llm = make_llm()
    with pytest.raises(InvalidRequest):
        llm.generate([[1, 2], [3, 4], []], GREEDY)
    assert not llm.engine.has_unfinished_requests()
    still_serves(llm)


def test_out_of_vocab_and_missing_prompt_are_rejected(make_llm):
    engine = make_llm().engine
    with pytest.raises(InvalidRequest, match="prompt_token_ids"):
        engine.add_request("a", None, GREEDY, prompt_token_ids=[1, 9999])
    with pytest.raises(InvalidRequest, match="prompt"):
        engine.add_request("b", None, GREEDY)


def test_duplicate_request_id_is_rejected(make_llm):
    engine = make_llm().engine
    engine.add_request("a", None, GREEDY, prompt_token_ids=[1, 2])
    with pytest.raises(InvalidRequest, match="already in use"):
        engine.add_request("a", None, GREEDY, prompt_token_ids=[3])
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("path", ["/nonexistent/model-dir", "./no/such/model/here"])
def test_unknown_model_path_says_not_found(path):
    with pytest.raises(InvalidRequest, match=f"model path or id '{path}' not found"):
        load_model(path, device="cpu")
    with pytest.raises(InvalidRequest, match="not found"):
        Engine(EngineConfig(model=path, device="cpu"))


def test_abort_frees_blocks_at_once_and_others_continue(make_llm):
    llm = make_llm()
    engine, manager = llm.engine, llm.engine.block_manager
    long = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    engine.add_request("victim", None, long, prompt_token_ids=list(range(30)))
    engine.add_request("other", None, GREEDY, prompt_token_ids=list(range(5)))
    engine.step()
    engine.step()
    engine.abort_request("victim")
    engine.abort_request("victim")  # idempotent
    engine.abort_request("never-existed")
    other_blocks = len(manager.block_table(engine.requests["other"].seqs[0].seq_id))
    assert manager.num_free_blocks == manager.num_blocks - 1 - other_blocks
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["other"]


def test_more_samples_than_max_num_seqs_is_rejected(make_llm):
    llm = make_llm(max_num_seqs=2)
    with pytest.raises(InvalidRequest, match="max_num_seqs"):
        llm.generate([[1, 2]], SamplingParams(n=3))
    still_serves(llm)


def test_without_chunked_prefill_prompts_must_fit_one_step(make_llm):
    llm = make_llm(enable_chunked_prefill=False, max_num_batched_tokens=16)
    assert llm.engine.max_model_len == 16
    with pytest.raises(PromptTooLong, match="max_num_batched_tokens"):
        llm.generate([list(range(20))], GREEDY)
    outputs = llm.generate([list(range(10)), list(range(12))], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert llm.engine.stats().num_split_prefills == 0


def test_a_failing_step_fails_its_batch_and_the_next_generate_still_works(make_llm):
    llm = make_llm()
    runner, calls = llm.engine.runner, []
    execute = runner.execute

    def fail_on_third_step(scheduled, *args, **kwargs):
        calls.append(len(scheduled))
        if len(calls) == 3:
            raise RuntimeError("simulated kernel failure")
        return execute(scheduled, *args, **kwargs)

    runner.execute = fail_on_third_step
    prompts = [list(range(3, 12)), list(range(20, 26))]
    with pytest.raises(RuntimeError, match="simulated kernel failure"):
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert not llm.engine.has_unfinished_requests()  # the failed batch is aborted, its blocks are free
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks - 1
    again = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in again] == [8, 8]
    runner.execute = execute
    fresh = make_llm().generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in fresh]
