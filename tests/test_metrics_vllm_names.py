"""/metrics under vLLM's names: each family vLLM has is also `vllm:<name>{model_name, engine="0"}`, with the same
samples as ours, on one model and on several; the per-request size histograms and tokens per step count what ran.
The live scrape by a real Prometheus, with PromQL as vLLM's dashboards write it, is in test_operate_live.py."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from paged_backend.engine import Engine, engine_config
from paged_backend.observability.metrics import one_two_five
from paged_backend.observability.vllm_names import VLLM_FAMILIES
from paged_backend.server.app import build_app
from paged_backend.server.multi_model import build_multi_model_app
from paged_backend.server.state import ServerSettings
from paged_backend.worker.default_model import TINY_MODEL

PROMPT = list(range(5, 25))  # 20 tokens, one prefill step


def tiny_engine() -> Engine:
    return Engine(engine_config(model=TINY_MODEL, device="cpu", num_blocks=64))


def families(client: TestClient) -> dict:
    text = client.get("/metrics").text
    return {family.name: family for family in text_string_to_metric_families(text)}


def samples(family, **drop) -> dict:
    """{(sample name without the prefix, labels but `drop`'s): value}."""
    prefix = family.name.split(":")[0] + ":"
    return {(s.name.removeprefix(prefix), tuple(sorted((k, v) for k, v in s.labels.items() if k not in drop))): s.value
            for s in family.samples}  # fmt: skip


@pytest.fixture(scope="module")
def single():
    engine = tiny_engine()
    with TestClient(build_app(engine, ServerSettings(served_model_name=["tiny", "tiny-alias"]))) as client:
        for n in (1, 2):
            body = {"model": "tiny-alias", "prompt": PROMPT, "max_tokens": 5, "n": n, "ignore_eos": True}
            answer = client.post("/v1/completions", json=body)
            assert answer.status_code == 200, answer.text
        yield client, engine


def test_every_vllm_family_repeats_ours_with_the_served_name(single):
    client, _ = single
    found = families(client)
    vllm = {name.removeprefix("vllm:") for name in found if name.startswith("vllm:") and not name.endswith("_created")}
    assert vllm == {name for name in VLLM_FAMILIES if f"paged_backend:{name}" in found} and len(vllm) >= 25
    assert "num_requests_swapped" not in vllm and "paged_backend:num_requests_swapped" in found  # V0's: ours only
    for name in vllm - {"engine_sleep_state"}:
        ours, theirs = found[f"paged_backend:{name}"], found[f"vllm:{name}"]
        assert theirs.type == ours.type, name
        assert all(s.labels["model_name"] == "tiny" and s.labels["engine"] == "0" for s in theirs.samples), name
        assert samples(theirs, model_name=1, engine=1) == samples(ours), name
    sleep = {s.labels["sleep_state"]: s.value for s in found["vllm:engine_sleep_state"].samples}
    assert sleep == {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}  # vLLM's names of the levels


def test_request_sizes_and_tokens_per_step_count_what_ran(single):
    client, engine = single
    found = families(client)

    def histogram(name):
        return {s.name.removeprefix(f"vllm:{name}"): s.value for s in found[f"vllm:{name}"].samples
                if "le" not in s.labels or s.name.endswith("_count")}  # fmt: skip

    assert histogram("request_prompt_tokens")["_sum"] == 2 * len(PROMPT)
    assert histogram("request_generation_tokens")["_sum"] == 5 + 2 * 5  # n=2 counts both completions
    assert histogram("request_max_num_generation_tokens")["_sum"] == 5 + 5
    assert histogram("request_params_n")["_sum"] == 1 + 2
    assert histogram("request_params_max_tokens")["_sum"] == 5 + 5
    assert histogram("request_time_per_output_token_seconds")["_count"] == 2
    assert histogram("request_inference_time_seconds")["_count"] == 2
    steps = histogram("iteration_tokens_total")
    stats = engine.stats()
    computed = stats.prompt_tokens - stats.prefix_cache_hits + stats.generation_tokens - 3
    assert stats.prefix_cache_hits == 16 and steps["_count"] == stats.num_steps and steps["_sum"] == computed
    # the second prompt's first block was a prefix hit; the last token of each of the 3 completions is sampled but
    # never fed back through a step
    buckets = [s.labels["le"] for s in found["vllm:request_prompt_tokens"].samples if s.name.endswith("_bucket")]
    assert buckets[:6] == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0"] and buckets[-1] == "+Inf"


def test_one_two_five_stops_at_the_limit():
    assert one_two_five(2048) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
    assert one_two_five(1) == (1,) and one_two_five(5) == (1, 2, 5)


def test_several_models_each_carry_their_own_name():
    router = build_multi_model_app({"a": tiny_engine(), "b": tiny_engine()}, ServerSettings())
    with TestClient(router) as client:
        answer = client.post("/v1/completions", json={"model": "b", "prompt": PROMPT, "max_tokens": 3,
                                                      "ignore_eos": True})  # fmt: skip
        assert answer.status_code == 200, answer.text
        found = families(client)
    generated = {s.labels["model_name"]: s.value for s in found["vllm:generation_tokens"].samples}
    assert generated == {"a": 0.0, "b": 3.0}
    ours = {s.labels["model_name"]: s.value for s in found["paged_backend:generation_tokens"].samples}
    assert ours == generated
