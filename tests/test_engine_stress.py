"""Random traffic on a tiny pool: preemption, forks, aborts and sampling together never leak or corrupt."""

import random

import pytest
from _engine_helpers import hf_greedy, make_llm_fixture  # noqa: F401

from paged_backend.engine import SamplingParams


@pytest.mark.parametrize(("seed", "swap_space"), [(0, 0.0), (1, 0.01), (2, 0.0)])
def test_random_traffic_keeps_greedy_exact_and_frees_every_block(make_llm, seed, swap_space):
    rng = random.Random(seed)
    llm = make_llm(num_blocks=28, block_size=4, watermark=0.0, swap_space=swap_space, max_num_batched_tokens=24,
                   max_num_seqs=6)
    engine = llm.engine
    expected: dict[str, tuple[list[int], int]] = {}
    aborted: set[str] = set()
    finished = {}
    for i in range(24):
        prompt = [rng.randrange(253) for _ in range(rng.randint(1, 30))]
        max_tokens = rng.randint(1, 12)
        if rng.random() < 0.5:
            params = SamplingParams(temperature=0, max_tokens=max_tokens)
            expected[str(i)] = (prompt, max_tokens)
        else:
            params = SamplingParams(n=rng.randint(1, 3), temperature=1.0, top_k=rng.choice([0, 5]),
                                    seed=rng.choice([None, i]), max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(str(i), None, params, prompt_token_ids=prompt)
        for _ in range(rng.randint(0, 3)):
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
        if rng.random() < 0.15:
            victim = str(rng.randrange(i + 1))
            engine.abort_request(victim)
            aborted.add(victim)
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert engine.stats().num_preemptions > 0
    for request_id, (prompt, max_tokens) in expected.items():
        if request_id in finished:
            assert finished[request_id].outputs[0].token_ids == hf_greedy("llama", prompt, max_tokens)
        else:
            assert request_id in aborted
    for output in finished.values():
        assert all(c.finish_reason in ("stop", "length") for c in output.outputs)
    assert engine.block_manager.stats().cpu_blocks_used == 0
