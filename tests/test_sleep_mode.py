"""Sleep mode against a real `serve --enable-sleep-mode` with a 256 MiB KV pool, through the OpenAI SDK and HTTP.

Level 1 gives the pool's memory back (the server process's RSS drops by >= 90% of the pool's bytes) and level 2
the weights too; waking gives the same greedy tokens as before, token for token, with the prefix cache emptied.
Asleep, generation gets 503 with Retry-After, /health says "sleeping" (503) and the metrics gauge shows the level.
Sleep with a request running answers 409 and the request still finishes; bad and repeated calls get clear answers.
"""

from __future__ import annotations

import httpx
import openai
import psutil
import pytest

from paged_backend.config import CacheConfig, EngineConfig
from paged_backend.config.speculative import SpeculativeConfig
from paged_backend.engine import Engine, SamplingParams
from paged_backend.engine.sleep import EngineSleep
from paged_backend.errors import InvalidRequest
from paged_backend.worker.models import embedded_model
from tests._server_helpers import API_KEY, MODEL, running_server, server_fixture

POOL_BYTES = 256 << 20
PROMPT = "A paged KV cache keeps each sequence in fixed-size blocks, so "  # longer than one 16-token block
server = server_fixture("--enable-sleep-mode", "--kv-cache-memory-bytes", str(POOL_BYTES))


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(autouse=True)
def awake_afterwards(request):
    """Every test on the module's server leaves it awake, whatever it asserted."""
    yield
    if "server" in request.fixturenames:
        request.getfixturevalue("server").post("/wake_up")


def greedy_tokens(client: openai.OpenAI, max_tokens: int = 24) -> list[str]:
    completion = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0, logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    return completion.choices[0].logprobs.tokens  # "token_id:N" each


def rss(server) -> int:
    return psutil.Process(server.process.pid).memory_info().rss


def sleep(server, level: int | str = 1) -> httpx.Response:
    return server.post("/sleep", params={"level": level})


def state(server) -> dict:
    response = httpx.get(f"{server.url}/is_sleeping", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    response.raise_for_status()
    return response.json()


def sleep_gauge(server) -> dict[str, float]:
    metrics = server.metrics()
    return {state: metrics[f'paged_backend:engine_sleep_state{{sleep_state="{state}"}}']
            for state in ("awake", "level_1", "level_2")}  # fmt: skip


def test_level_1_frees_the_pool_and_waking_gives_the_same_tokens_with_an_empty_prefix_cache(server, client):
    before = greedy_tokens(client)
    assert greedy_tokens(client) == before  # the second run reads the prompt's full blocks from the prefix cache
    hits = server.metrics()["paged_backend:prefix_cache_hits_total"]
    assert hits > 0
    awake_rss = rss(server)
    response = sleep(server, 1)
    assert response.status_code == 200 and response.json() == {"is_sleeping": True, "level": 1}
    freed = awake_rss - rss(server)
    assert freed >= 0.9 * POOL_BYTES, f"level 1 freed {freed / 2**20:.0f} MiB of a {POOL_BYTES >> 20} MiB pool"
    response = server.post("/wake_up")
    assert response.status_code == 200 and response.json() == {"is_sleeping": False, "level": 0}
    assert server.metrics()["paged_backend:kv_cache_usage_perc"] == 0  # every block free again
    assert greedy_tokens(client) == before
    assert server.metrics()["paged_backend:prefix_cache_hits_total"] == hits  # the cached prefixes were forgotten


def test_level_2_drops_the_weights_reloads_them_and_gives_the_same_tokens(server, client):
    before = greedy_tokens(client)
    awake_rss = rss(server)
    assert sleep(server, 2).json() == {"is_sleeping": True, "level": 2}
    assert awake_rss - rss(server) >= 0.9 * POOL_BYTES
    assert state(server) == {"is_sleeping": True, "level": 2}
    assert server.post("/wake_up").json() == {"is_sleeping": False, "level": 0}
    assert greedy_tokens(client) == before


def test_wake_up_tags_bring_back_the_weights_then_the_kv_cache_as_rlhf_does(server, client):
    """vLLM's tags: the weights first (a trainer syncs them), then the KV cache; serving starts with the last."""
    before = greedy_tokens(client)
    assert sleep(server, 2).status_code == 200
    assert server.post("/wake_up", params={"tags": "weights"}).json() == {"is_sleeping": True, "level": 1}
    with pytest.raises(openai.APIStatusError) as refused:  # the KV cache is still asleep
        greedy_tokens(client)
    assert refused.value.status_code == 503
    assert server.post("/wake_up", params={"tags": "kv_cache"}).json() == {"is_sleeping": False, "level": 0}
    assert greedy_tokens(client) == before
    bogus = server.post("/wake_up", params={"tags": "optimizer"})
    assert bogus.status_code == 400 and "wake_up tags 'optimizer' do not exist" in bogus.json()["error"]["message"]


def test_asleep_generation_gets_503_with_retry_after_health_says_sleeping_metrics_show_the_level(server, client):
    assert sleep_gauge(server) == {"awake": 1, "level_1": 0, "level_2": 0}
    assert sleep(server, 1).status_code == 200
    with pytest.raises(openai.APIStatusError) as refused:
        greedy_tokens(client)
    assert refused.value.status_code == 503 and "asleep" in refused.value.message
    assert int(refused.value.response.headers["retry-after"]) > 0
    with pytest.raises(openai.APIStatusError) as refused_stream:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True)
    assert refused_stream.value.status_code == 503
    health = httpx.get(f"{server.url}/health", timeout=30)
    assert health.status_code == 503 and health.json()["status"] == "sleeping"
    assert int(health.headers["retry-after"]) > 0
    assert sleep_gauge(server) == {"awake": 0, "level_1": 1, "level_2": 0}
    assert client.models.list().data[0].id == MODEL  # what needs no weights still answers
    server.post("/wake_up")
    assert server.health()["status"] == "ok"
    assert sleep_gauge(server) == {"awake": 1, "level_1": 0, "level_2": 0}


def test_sleep_while_a_request_runs_answers_409_and_the_request_still_finishes(server, client):
    # a couple of thousand tokens (seconds of work), so the request still runs at the /sleep: a short one could
    # finish server-side, its bytes in the socket's buffers, before the call
    stream = client.completions.create(model=MODEL, prompt="Long", max_tokens=2000, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    chunks = [next(stream)]
    response = sleep(server, 1)
    assert response.status_code == 409, response.text
    error = response.json()["error"]
    assert error["code"] == "requests_in_flight" and chunks[0].id in error["message"]  # names the request
    chunks += list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert len("".join(chunk.choices[0].text for chunk in chunks)) > 0
    assert state(server) == {"is_sleeping": False, "level": 0}


def test_bad_levels_are_400_and_repeated_calls_answer_the_state_they_leave(server):
    for level in (0, 3, "deep"):
        response = sleep(server, level)
        assert response.status_code == 400 and "level" in response.json()["error"]["message"], response.text
    assert server.post("/wake_up").json() == {"is_sleeping": False, "level": 0}  # already awake: nothing to do
    assert sleep(server, 1).json() == {"is_sleeping": True, "level": 1}
    assert sleep(server, 1).json() == {"is_sleeping": True, "level": 1}  # already there
    assert sleep(server, 2).json() == {"is_sleeping": True, "level": 2}  # deeper: the weights go too
    assert sleep(server, 1).json() == {"is_sleeping": True, "level": 2}  # lighter: stays as deep as it is
    assert server.post("/wake_up").json() == {"is_sleeping": False, "level": 0}
    assert server.post("/wake_up").json() == {"is_sleeping": False, "level": 0}


def test_the_routes_need_the_api_key(server):
    for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")):
        response = httpx.request(method, f"{server.url}{path}", timeout=30)
        assert response.status_code == 401, response.text
    assert state(server)["is_sleeping"] is False


def test_the_routes_are_404_without_the_flag():
    with running_server("--num-blocks", "64") as plain:
        for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")):
            response = httpx.request(method, f"{plain.url}{path}", headers={"Authorization": f"Bearer {API_KEY}"})
            assert response.status_code == 404 and "--enable-sleep-mode" in response.json()["error"]["message"]
        assert plain.health()["status"] == "ok"


def test_in_process_a_draft_models_pool_sleeps_too_and_a_handed_model_cannot_sleep_at_level_2():
    config = EngineConfig(model=MODEL, device="cpu", cache=CacheConfig(num_blocks=128),
                          speculative_config=SpeculativeConfig(model=MODEL, num_speculative_tokens=3))  # fmt: skip
    engine = Engine(config)
    sleep_state = EngineSleep(engine)

    def tokens(request_id: str) -> list[int]:
        engine.add_request(request_id, PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        while engine.has_unfinished_requests():
            outputs = engine.step()
        return outputs[0].outputs[0].token_ids

    before = tokens("a")
    sleep_state.sleep(2)
    assert engine.kv_cache.total_bytes == engine.speculator.draft.kv_cache.total_bytes == 0
    sleep_state.wake_up()
    assert tokens("b") == before and engine.speculator.num_accepted_tokens > 0

    model, tokenizer = embedded_model()
    handed = EngineSleep(Engine(EngineConfig(device="cpu", cache=CacheConfig(num_blocks=16)), model=model,
                                tokenizer=tokenizer))  # fmt: skip
    with pytest.raises(InvalidRequest, match="handed"):
        handed.sleep(2)
    handed.sleep(1)  # its pool is the engine's own
    assert handed.level == 1
