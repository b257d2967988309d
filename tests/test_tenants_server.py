"""One real `serve` for every multi-tenant check (one start-up, to keep the suite short): a tiny Llama and a tiny
Qwen2 behind one server (`--config` YAML plus shared LoRA flags), each with peft adapters.

- `model=<adapter>` and `model=<base>` requests of both models, sent concurrently so steps mix adapters (max_loras
  2 of 3), equal peft's own greedy generate (the bases: HF generate);
- `/v1/models` lists both models and their adapters with `parent`; vLLM's runtime load / unload;
- 32 concurrent streams across both finish; one model's overload does not starve the other; an unknown model is
  a 404 naming the served ones; per-model /health and /metrics (`model_name`, `lora_requests_info`).
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from _lora_helpers import DTYPE, PROMPTS, expected_tokens, save_base_and_adapters
from _server_helpers import running_server

MAX_TOKENS = 8
MODELS = {"llama": "llama", "qwen": "qwen2"}  # served name: architecture


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("tenants")
    dirs, adapters, expected = {}, {}, {}
    for name, arch in MODELS.items():
        dirs[name], saved = save_base_and_adapters(arch, root)
        adapters.update({f"{name}-{adapter}": path for adapter, path in saved.items()})
        for adapter, tokens in expected_tokens(arch, saved, MAX_TOKENS).items():
            expected[name if adapter is None else f"{name}-{adapter}"] = tokens
    qwen_modules = "".join(f"\n      {n}: {p}" for n, p in adapters.items() if n.startswith("qwen-"))
    config = root / "models.yaml"
    config.write_text(
        f"models:\n  - model: {dirs['llama']}\n    served_model_name: llama\n"
        f"  - model: {dirs['qwen']}\n    served_model_name: qwen\n    lora_modules:{qwen_modules}\n"
    )
    # --dtype for both models: peft's reference is float32 (auto is bfloat16 on CPUs with AMX or AVX512-BF16)
    flags = ["--config", str(config), "--dtype", DTYPE, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
             "--lora-modules", f"llama-attn4={adapters['llama-attn4']}",
             "--lora-modules", json.dumps({"name": "llama-all8", "path": str(adapters["llama-all8"])}),
             "--allow-runtime-lora-updating", "--num-blocks", "96", "--block-size", "4"]  # fmt: skip
    with running_server(*flags) as server:
        yield server, adapters, expected


def _tokens(client: openai.OpenAI, model: str, prompt: list[int]) -> list[int]:
    completion = client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
        extra_body={"return_tokens_as_token_ids": True},
    )  # fmt: skip
    return [int(token.removeprefix("token_id:")) for token in completion.choices[0].logprobs.tokens]


def test_models_lists_both_models_and_their_adapters(setup):
    server, adapters, _ = setup
    cards = {card.id: card for card in server.client().models.list().data}
    assert {name: getattr(card, "parent", None) for name, card in cards.items()} == {
        "llama": None, "llama-attn4": "llama", "llama-all8": "llama",
        "qwen": None, "qwen-attn4": "qwen", "qwen-all8": "qwen", "qwen-mlp2": "qwen",
    }  # fmt: skip
    assert cards["qwen-mlp2"].root == str(adapters["qwen-mlp2"])


def test_adapters_and_bases_of_both_models_mixed_equal_peft_then_unload(setup):
    server, adapters, expected = setup
    client = server.client()
    body = {"lora_name": "llama-mlp2", "lora_path": str(adapters["llama-mlp2"]), "model": "llama"}
    assert server.post("/v1/load_lora_adapter", json=body).status_code == 200
    again = server.post("/v1/load_lora_adapter", json=body)
    assert again.status_code == 400 and "already served" in again.text
    jobs = [(name, index) for name in expected for index in range(len(PROMPTS))]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: _tokens(client, job[0], PROMPTS[job[1]]), jobs))
    for (name, index), tokens in zip(jobs, results, strict=True):
        assert tokens == expected[name][index], name
    unload = {"lora_name": "llama-mlp2"}  # routed to the model that holds the adapter
    assert server.post("/v1/unload_lora_adapter", json=unload).status_code == 200
    with pytest.raises(openai.NotFoundError, match="qwen-mlp2"):  # the 404 names everything served
        _tokens(client, "llama-mlp2", PROMPTS[0])
    assert server.post("/v1/unload_lora_adapter", json=unload).status_code == 404


def test_an_answer_names_the_adapter_or_model_the_request_asked_for(setup):
    """vLLM's rule: an adapter's answers carry the adapter's name, the base model's its own."""
    server, _, _ = setup
    client = server.client()
    for model in ("llama", "llama-attn4", "qwen-mlp2"):
        completion = client.completions.create(model=model, prompt="hi", max_tokens=1)
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
        response = client.responses.create(model=model, input="hi", max_output_tokens=1, store=False)
        assert (completion.model, chat.model, response.model) == (model, model, model)


def test_a_bad_runtime_adapter_is_a_400_naming_the_fix(setup, tmp_path):
    server, _, _ = setup
    body = {"lora_name": "x", "lora_path": str(tmp_path / "absent"), "model": "qwen"}
    absent = server.post("/v1/load_lora_adapter", json=body)
    assert absent.status_code == 400 and "not a directory" in absent.json()["error"]["message"]
    assert "x" not in {card.id for card in server.client().models.list().data}
    nameless = server.post("/v1/load_lora_adapter", json={**body, "lora_name": ""})
    assert nameless.status_code == 400 and "lora_name" in nameless.json()["error"]["message"]
    assert "LoRARequest" not in nameless.text


def test_32_concurrent_streams_across_both_models_finish(setup):
    server, _, _ = setup

    async def stream(client: openai.AsyncOpenAI, index: int) -> str | None:
        model = ["llama", "qwen", "qwen-all8", "llama-attn4"][index % 4]
        chunks = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"hello {index}"}], max_tokens=16, stream=True
        )
        reason = None
        async for chunk in chunks:
            if chunk.choices and chunk.choices[0].finish_reason:
                reason = chunk.choices[0].finish_reason
        return reason

    async def run() -> list[str | None]:
        client = server.async_client()
        return await asyncio.gather(*(stream(client, i) for i in range(32)))

    assert all(reason in ("stop", "length") for reason in asyncio.run(run()))


def test_one_models_overload_never_starves_the_others_admission(setup):
    """Flood llama far past its 96-block pool; a qwen request is admitted and finishes meanwhile."""
    server, _, _ = setup

    async def run() -> tuple[float, float]:
        client = server.async_client()
        flood = [asyncio.ensure_future(client.completions.create(model="llama", prompt=PROMPTS[0] * 2, max_tokens=48,
                                                                 temperature=0, extra_body={"ignore_eos": True}))
                 for _ in range(24)]  # fmt: skip
        await asyncio.sleep(0.5)
        await client.completions.create(model="qwen", prompt=PROMPTS[1], max_tokens=4, temperature=0)
        qwen_done = asyncio.get_running_loop().time()
        await asyncio.gather(*flood)
        return qwen_done, asyncio.get_running_loop().time()

    qwen_done, flood_done = asyncio.run(run())
    assert qwen_done < flood_done  # answered while llama still worked through its backlog


def test_unknown_model_404_health_and_metrics_per_model(setup):
    server, _, _ = setup
    with pytest.raises(openai.NotFoundError) as caught:
        server.client().completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert "'llama'" in caught.value.body["message"] and "'qwen'" in caught.value.body["message"]
    health = server.health()
    assert health["status"] == "ok" and set(health["models"]) == set(MODELS)
    metrics = server.metrics()
    for name in MODELS:
        assert metrics[f'paged_backend:generation_tokens_total{{model_name="{name}"}}'] > 0
        info = [
            key
            for key in metrics
            if key.startswith("paged_backend:lora_requests_info") and f'model_name="{name}"' in key
        ]
        assert len(info) == 1 and 'max_lora="2"' in info[0]
