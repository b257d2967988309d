"""LoRA on the OpenAI server: `model=<adapter>` picks the adapter, concurrent requests of three adapters and
the base model equal peft's greedy tokens, `/v1/models` lists adapters with their parent, runtime load and
unload, vLLM's lora_requests_info metric."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from _lora_helpers import PROMPTS, expected_tokens, save_base_and_adapters
from _server_helpers import running_server

MAX_TOKENS = 8
BASE = "tiny-llama"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model_dir, adapters = save_base_and_adapters("llama", tmp_path_factory.mktemp("lora-server"))
    expected = expected_tokens("llama", adapters, MAX_TOKENS)
    flags = ["--model", str(model_dir), "--served-model-name", BASE, "--enable-lora", "--max-loras", "2",
             "--max-lora-rank", "8", "--num-blocks", "128", "--block-size", "4",
             "--lora-modules", f"attn4={adapters['attn4']}",
             "--lora-modules", json.dumps({"name": "all8", "path": str(adapters["all8"])}),
             "--allow-runtime-lora-updating"]  # fmt: skip
    with running_server(*flags) as server:
        yield server, adapters, expected


def _tokens(client: openai.OpenAI, model: str, prompt: list[int]) -> list[int]:
    completion = client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
        extra_body={"return_tokens_as_token_ids": True},
    )  # fmt: skip
    return [int(token.removeprefix("token_id:")) for token in completion.choices[0].logprobs.tokens]


def test_models_lists_the_base_and_its_adapters(setup):
    server, adapters, _ = setup
    cards = {card.id: card for card in server.client().models.list().data}
    assert set(cards) == {BASE, "attn4", "all8"}
    assert cards["attn4"].parent == BASE and cards["all8"].parent == BASE
    assert cards["attn4"].root == str(adapters["attn4"])


def test_runtime_load_then_a_mixed_batch_equals_peft_then_unload(setup):
    server, adapters, expected = setup
    client = server.client()
    loaded = server.post("/v1/load_lora_adapter", json={"lora_name": "mlp2", "lora_path": str(adapters["mlp2"])})
    assert loaded.status_code == 200, loaded.text
    again = server.post("/v1/load_lora_adapter", json={"lora_name": "mlp2", "lora_path": str(adapters["mlp2"])})
    assert again.status_code == 400 and "already served" in again.text
    jobs = [(name, index) for name in [BASE, "attn4", "all8", "mlp2"] for index in range(len(PROMPTS))]
    with ThreadPoolExecutor(len(jobs)) as pool:  # concurrent: the steps mix adapters (max_loras=2 of 3)
        results = list(pool.map(lambda job: _tokens(client, job[0], PROMPTS[job[1]]), jobs))
    for (name, index), tokens in zip(jobs, results, strict=True):
        assert tokens == expected[None if name == BASE else name][index], name
    assert server.post("/v1/unload_lora_adapter", json={"lora_name": "mlp2"}).status_code == 200
    with pytest.raises(openai.NotFoundError, match="attn4"):  # the 404 names what is served
        _tokens(client, "mlp2", PROMPTS[0])
    missing = server.post("/v1/unload_lora_adapter", json={"lora_name": "mlp2"})
    assert missing.status_code == 404
    metrics = server.wait_until_drained()
    info = [key for key in metrics if key.startswith("paged_backend:lora_requests_info")]
    assert len(info) == 1 and 'max_lora="2"' in info[0]


def test_bad_runtime_adapters_get_a_400_naming_the_fix(setup, tmp_path):
    server, adapters, _ = setup
    absent = server.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path / "absent")})
    assert absent.status_code == 400 and "not a directory" in absent.json()["error"]["message"]
    names = {card.id for card in server.client().models.list().data}
    assert names == {BASE, "attn4", "all8"}
    server.wait_until_drained()
