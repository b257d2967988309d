"""Priorities and the "batch" class in the scheduler, step by step on the tiny model, plus one real server.

Under the "priority" policy a waiting request that cannot get blocks or a seat preempts the running requests it
outranks, worst first; "batch" requests run only on capacity interactive ones leave over, and go first when room is
needed, under either policy; fcfs keeps arrival order. Every scenario checks that preempted requests still produce
exactly their greedy tokens alone, and that every block is free again at the end.
"""

from __future__ import annotations

import itertools
import threading
import time

import pytest
from _engine_helpers import make_llm_fixture  # noqa: F401
from _server_helpers import MODEL, server_fixture

from paged_backend.engine import SamplingParams
from paged_backend.engine.request import SequenceStatus
from paged_backend.errors import InvalidRequest

LONG = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
LOW_PROMPTS = [[index + 1] * 24 for index in range(4)]  # 6 blocks of 4 each, growing to 12
HIGH_PROMPT = list(range(30, 50))  # 5 blocks

server = server_fixture("--scheduling-policy", "priority", "--max-num-seqs", "1")


class Scenario:
    """An engine stepped by hand: requests join at given steps; it records who finished when and with what."""

    def __init__(self, engine) -> None:
        self.engine, self.step_count = engine, 0
        self.finished: list[str] = []
        self.tokens: dict[str, list[int]] = {}
        self.first_token_step: dict[str, int] = {}
        self.requests: dict[str, tuple[list[int], SamplingParams]] = {}

    def add(self, request_id: str, prompt: list[int], params: SamplingParams, **options) -> None:
        self.requests[request_id] = prompt, params
        self.engine.add_request(request_id, None, params, prompt_token_ids=prompt, **options)

    def step(self) -> None:
        for output in self.engine.step():
            self.first_token_step.setdefault(output.request_id, self.step_count)
            if output.finished:
                self.finished.append(output.request_id)
                self.tokens[output.request_id] = output.outputs[0].token_ids
        self.step_count += 1

    def run(self, until_step: int | None = None) -> None:
        while self.engine.has_unfinished_requests() and (until_step is None or self.step_count < until_step):
            self.step()

    def status(self, request_id: str) -> SequenceStatus:
        return self.engine.requests[request_id].seqs[0].status

    def check_exact_and_leak_free(self, make_llm) -> None:
        """Everyone finished with the tokens it gets alone, and every block is free again."""
        assert not self.engine.has_unfinished_requests()
        manager = self.engine.block_manager
        assert manager.num_free_blocks == manager.num_blocks - 1
        alone = make_llm()
        for request_id, (prompt, params) in self.requests.items():
            expected = alone.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
            assert self.tokens[request_id] == expected, request_id


def crowded(make_llm, policy: str, mode: str = "recompute", **options):
    """Room for the four long requests' prompts and a little growth (the pool holds 32 blocks of 4 tokens)."""
    swap = {"swap_space": 0.001, "preemption_mode": "swap"} if mode == "swap" else {}
    return Scenario(make_llm(num_blocks=33, policy=policy, **swap, **options).engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_high_priority_request_preempts_low_ones_for_blocks_and_finishes_first(make_llm, mode):
    scenario = crowded(make_llm, "priority", mode)
    for index, prompt in enumerate(LOW_PROMPTS):
        scenario.add(f"low{index}", prompt, LONG, priority=5)
    scenario.run(until_step=3)
    assert scenario.engine.block_manager.num_free_blocks < 5  # the high one's prompt does not fit as things are
    scenario.add("high", HIGH_PROMPT, SHORT, priority=0)
    scenario.run(until_step=4)
    assert scenario.first_token_step["high"] == 3  # admitted in the very step it arrived
    assert scenario.status("low3") is not SequenceStatus.RUNNING  # the latest of the lowest went
    assert scenario.engine.scheduler.num_preemptions >= 1
    scenario.run()
    assert scenario.finished[0] == "high"
    scenario.check_exact_and_leak_free(make_llm)


def test_a_high_priority_request_preempts_the_worst_running_one_for_a_seat(make_llm):
    scenario = Scenario(make_llm(max_num_seqs=4, policy="priority").engine)
    for index, (prompt, priority) in enumerate(zip(LOW_PROMPTS, [3, 7, 5, 5], strict=True)):
        scenario.add(f"low{index}", prompt, LONG, priority=priority)
    scenario.run(until_step=2)
    scenario.add("high", HIGH_PROMPT, SHORT, priority=1)
    scenario.run(until_step=3)
    assert scenario.first_token_step["high"] == 2
    waiting = [name for name in ("low0", "low1", "low2", "low3") if scenario.status(name) is not SequenceStatus.RUNNING]
    assert waiting == ["low1"] and scenario.engine.scheduler.num_preemptions == 1  # priority 7: one seat, one victim
    scenario.run()
    assert scenario.finished[0] == "high"
    scenario.check_exact_and_leak_free(make_llm)


def test_a_request_that_would_not_fit_anyway_preempts_nobody(make_llm):
    scenario = Scenario(make_llm(num_blocks=21, policy="priority").engine)
    scenario.add("mid", [1] * 40, SHORT, priority=0)  # 11 blocks by step 2
    scenario.add("low", [2] * 8, SHORT, priority=5)  # 3 blocks by step 2
    scenario.run(until_step=2)
    # 40 prompt tokens need 10 blocks: 6 are free, 9 with "low" gone; "mid" outranks the newcomer and stays.
    scenario.add("huge", [3] * 40, SHORT, priority=1)
    scenario.run(until_step=4)
    assert scenario.status("low") is SequenceStatus.RUNNING and scenario.status("huge") is SequenceStatus.WAITING
    scenario.run()
    assert scenario.engine.scheduler.num_preemptions == 0
    assert scenario.finished == ["mid", "low", "huge"]
    scenario.check_exact_and_leak_free(make_llm)


def test_fcfs_keeps_arrival_order_and_preempts_nobody_for_a_newcomer(make_llm):
    scenario = Scenario(make_llm(max_num_seqs=4, policy="fcfs").engine)
    for index, prompt in enumerate(LOW_PROMPTS):
        scenario.add(f"low{index}", prompt, LONG, priority=5)
    scenario.run(until_step=2)
    scenario.add("high", HIGH_PROMPT, SHORT, priority=0)  # fcfs ignores the priority field
    scenario.run()
    assert scenario.engine.scheduler.num_preemptions == 0
    assert scenario.finished == ["low0", "low1", "low2", "low3", "high"]
    assert scenario.first_token_step["high"] > scenario.first_token_step["low0"] + LONG.max_tokens - 2
    scenario.check_exact_and_leak_free(make_llm)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_batch_requests_wait_while_interactive_ones_are_waiting(make_llm, policy):
    scenario = Scenario(make_llm(max_num_seqs=2, policy=policy).engine)
    scenario.add("batch0", [1] * 8, SHORT, request_class="batch", priority=-10)  # first, and the best priority
    scenario.add("batch1", [2] * 8, SHORT, request_class="batch", priority=-10)
    for index in range(3):
        scenario.add(f"chat{index}", [index + 3] * 8, SHORT, priority=10)
    scheduler = scenario.engine.scheduler
    while scenario.engine.has_unfinished_requests():
        scenario.step()
        interactive_waiting = any(seq.request.request_class == "interactive" for seq in scheduler.waiting)
        assert not (interactive_waiting and any(seq.request.request_class == "batch" for seq in scheduler.running))
    first = scenario.first_token_step
    assert max(first[f"chat{index}"] for index in range(3)) <= min(first["batch0"], first["batch1"])
    assert scenario.engine.scheduler.num_preemptions == 0  # the batch ones were never admitted early to be evicted
    scenario.check_exact_and_leak_free(make_llm)


@pytest.mark.parametrize(("policy", "mode"), [("fcfs", "recompute"), ("priority", "swap")])
def test_batch_requests_are_preempted_first_when_interactive_work_needs_room(make_llm, policy, mode):
    scenario = crowded(make_llm, policy, mode)
    scenario.add("batch", LOW_PROMPTS[0], LONG, request_class="batch", priority=-10)  # oldest, best priority
    for index, prompt in enumerate(LOW_PROMPTS[1:]):
        scenario.add(f"chat{index}", prompt, LONG)
    scenario.run(until_step=3)
    scenario.add("late", HIGH_PROMPT, SHORT)  # interactive, arriving when its prompt does not fit
    scenario.run(until_step=4)
    assert scenario.first_token_step["late"] == 3
    assert scenario.status("batch") is not SequenceStatus.RUNNING
    assert all(scenario.status(f"chat{index}") is SequenceStatus.RUNNING for index in range(3))
    scenario.run()
    assert scenario.finished[-1] == "batch"  # it came back only once every interactive request had room
    scenario.check_exact_and_leak_free(make_llm)


def test_an_interactive_newcomer_never_waits_on_a_batch_prompt_being_prefilled(make_llm):
    scenario = Scenario(make_llm(max_num_batched_tokens=16, policy="fcfs").engine)
    scenario.add("batch", [1] * 64, SHORT, request_class="batch")  # four 16-token chunks alone
    scenario.run(until_step=1)
    scenario.add("chat", [2] * 8, SHORT)
    scenario.run(until_step=2)
    assert scenario.first_token_step["chat"] == 1  # its whole prompt ran in the step it arrived
    assert scenario.engine.requests["batch"].seqs[0].num_computed_tokens == 16  # the batch chunk sat that step out
    scenario.run()
    scenario.check_exact_and_leak_free(make_llm)


def scheduled_ids(engine) -> list[str]:
    """Run one step; the requests it computed (the plan is read back through the scheduler's own call)."""
    plans = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
    try:
        engine.step()
    finally:
        del engine.scheduler.schedule
    return sorted(item.seq.request.request_id for item in plans[0].scheduled)


@pytest.mark.parametrize(("policy", "options"), [("priority", {"priority": 0}), ("fcfs", {})])
def test_a_better_ranked_prefill_runs_alone_and_the_decodes_it_outranks_resume_next_step(make_llm, policy, options):
    low = {"priority": 5} if policy == "priority" else {"request_class": "batch"}
    scenario = Scenario(make_llm(policy=policy).engine)
    for index, prompt in enumerate(LOW_PROMPTS[:3]):
        scenario.add(f"low{index}", prompt, LONG, **low)
    scenario.add("peer", LOW_PROMPTS[3], LONG, priority=0)  # ranks with the newcomer: it is not deferred
    scenario.run(until_step=2)
    scenario.add("high", HIGH_PROMPT, SHORT, **options)
    assert scheduled_ids(scenario.engine) == ["high", "peer"]  # the prefill step: no decode it outranks
    assert scheduled_ids(scenario.engine) == ["high", "low0", "low1", "low2", "peer"]  # all decode together again
    assert scenario.engine.scheduler.num_preemptions == 0
    scenario.run()
    scenario.check_exact_and_leak_free(make_llm)


def test_decodes_are_not_held_back_for_a_better_request_that_cannot_be_admitted(make_llm):
    scenario = Scenario(make_llm(num_blocks=21, policy="priority").engine)
    scenario.add("best", [1] * 40, SHORT, priority=0)  # 11 blocks by step 2, and it outranks the newcomer
    scenario.add("low", [2] * 8, SHORT, priority=5)
    scenario.run(until_step=2)
    scenario.add("huge", [3] * 40, SHORT, priority=1)  # does not fit even with "low" gone: preempts nobody
    assert scheduled_ids(scenario.engine) == ["best", "low"]
    scenario.run()
    assert scenario.engine.scheduler.num_preemptions == 0
    scenario.check_exact_and_leak_free(make_llm)


def test_decodes_take_turns_when_the_token_budget_is_smaller_than_the_batch(make_llm):
    scenario = Scenario(make_llm(max_num_batched_tokens=96).engine)
    for index in range(4):
        scenario.add(f"r{index}", [index + 1] * 24, LONG)
    scenario.run(until_step=2)
    engine = scenario.engine
    assert all(seq.is_decoding for seq in engine.scheduler.running) and len(engine.scheduler.running) == 4
    engine.scheduler.config.max_num_batched_tokens = 3  # three of the four decodes fit a step from now on
    rounds = [scheduled_ids(engine) for _ in range(4)]
    assert all(len(ids) == 3 for ids in rounds)
    for first, second in itertools.pairwise(rounds):
        assert set(first) | set(second) == {"r0", "r1", "r2", "r3"}  # the one left out goes first next step
    scenario.run()
    scenario.check_exact_and_leak_free(make_llm)


def arriving_during_the_next_step(engine, priority: int, after_layers: int = 0) -> list[bool]:
    """Make the next step's forward see a request of `priority` arrive once `after_layers` layers ran (as a server
    thread's `cut_step_for` would); returns what `cut_step_for` answered."""
    execute, answers = engine.runner.execute, []

    def execute_with_arrival(rows, extra_rows=(), cut=None):
        checks = iter(range(1000))

        def arrives_then_cut() -> bool:
            if next(checks) == after_layers:
                answers.append(engine.cut_step_for(priority))
            return cut()

        engine.runner.execute = execute
        return execute(rows, extra_rows, cut=arrives_then_cut)

    engine.runner.execute = execute_with_arrival
    return answers


@pytest.mark.parametrize("after_layers", [0, 1])
def test_a_step_is_cut_for_a_request_that_outranks_all_it_computes_and_redone_exactly(make_llm, after_layers):
    scenario = Scenario(make_llm(policy="priority").engine)
    for index, prompt in enumerate(LOW_PROMPTS):
        scenario.add(f"low{index}", prompt, LONG, priority=5)
    scenario.run(until_step=3)
    engine = scenario.engine
    free_before = engine.block_manager.num_free_blocks
    answers = arriving_during_the_next_step(engine, priority=0, after_layers=after_layers)
    assert scheduled_ids(engine) == ["low0", "low1", "low2", "low3"] and answers == [True]
    assert engine.stats().num_cut_steps == 1
    assert engine.block_manager.num_free_blocks == free_before  # the cut step kept its slots for the redo
    scenario.add("high", HIGH_PROMPT, SHORT, priority=0)
    assert scheduled_ids(engine) == ["high"]  # its prefill alone, then everyone together
    assert scheduled_ids(engine) == ["high", "low0", "low1", "low2", "low3"]
    scenario.run()
    scenario.check_exact_and_leak_free(make_llm)  # the partly written layers of the cut step were redone exactly


def test_a_request_that_does_not_outrank_the_whole_step_does_not_cut_it(make_llm):
    scenario = Scenario(make_llm(policy="priority").engine)
    scenario.add("mid", LOW_PROMPTS[0], LONG, priority=1)
    scenario.add("low", LOW_PROMPTS[1], LONG, priority=5)
    scenario.run(until_step=2)
    engine = scenario.engine
    assert not engine.cut_step_for(0)  # no step in flight
    answers = arriving_during_the_next_step(engine, priority=1)  # ranks above "low" only
    assert scheduled_ids(engine) == ["low", "mid"] and answers == [False]
    assert engine.stats().num_cut_steps == 0
    scenario.run()
    scenario.check_exact_and_leak_free(make_llm)


def test_an_unknown_request_class_is_refused_with_the_choices(make_llm):
    engine = make_llm().engine
    with pytest.raises(InvalidRequest, match="interactive, batch"):
        engine.add_request("x", None, SHORT, prompt_token_ids=[1, 2], request_class="bulk")
    assert not engine.has_unfinished_requests()


def test_a_chat_request_priority_is_honoured_by_a_priority_server(server):
    """One seat (--max-num-seqs 1): a priority -1 chat preempts a running low-priority stream and is answered while
    that stream still has most of its 2000 tokens to go (fcfs would answer it only after them)."""
    client = server.client()
    low_chunks: list[str] = []
    low_finish: list[str | None] = []
    answered = threading.Event()

    def consume_low() -> None:
        stream = client.completions.create(
            model=MODEL, prompt="low", max_tokens=2000, stream=True, extra_body={"ignore_eos": True, "priority": 5}
        )
        with stream:
            for chunk in stream:
                low_chunks.append(chunk.choices[0].text)
                low_finish.append(chunk.choices[0].finish_reason)
                if answered.is_set():
                    break  # closing the stream aborts the rest

    low = threading.Thread(target=consume_low)
    low.start()
    while not low_chunks:  # the low stream holds the only seat
        time.sleep(0.01)
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "urgent"}], max_tokens=8,
        extra_body={"priority": -1, "ignore_eos": True},
    )  # fmt: skip
    finished_before = [reason for reason in low_finish if reason is not None]
    answered.set()
    low.join(timeout=120)
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 8
    assert finished_before == [] and len(low_chunks) < 2000
    assert server.wait_until_drained()["paged_backend:num_preemptions_total"] >= 1
