"""Several models behind one `serve`: routing by `model`, each equal to its HF generate, 32 concurrent streams
across both, a 404 naming the served models, per-model /health and /metrics; config files and the KV split."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import torch
from _server_helpers import running_server

from paged_backend.config import EngineConfig
from paged_backend.errors import InvalidRequest
from paged_backend.models import byte_tokenizer, tiny_model
from paged_backend.server.multi_model import build_engines, model_specs

MODELS = {"llama": ("llama", 3), "qwen": ("qwen2", 5)}  # served name: (architecture, seed)
PROMPT = [5, 17, 99, 3, 42, 7, 250, 11]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    flags = []
    for name, (arch, seed) in MODELS.items():
        directory = tmp_path_factory.mktemp(name)
        tiny_model(arch, seed=seed).save_pretrained(directory)
        byte_tokenizer().save_pretrained(directory)
        flags += ["--model", str(directory), "--served-model-name", name]
    with running_server(*flags, "--num-blocks", "96", "--block-size", "4") as running:
        yield running


def _hf_tokens(arch: str, seed: int) -> list[int]:
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = tiny_model(arch, seed=seed).generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False
        )
    return out[0, len(PROMPT) :].tolist()


def test_each_request_routes_to_its_model_and_equals_its_hf_generate(server):
    client = server.client()
    for name, (arch, seed) in MODELS.items():
        completion = client.completions.create(
            model=name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
            extra_body={"return_tokens_as_token_ids": True},
        )  # fmt: skip
        tokens = [int(t.removeprefix("token_id:")) for t in completion.choices[0].logprobs.tokens]
        assert tokens == _hf_tokens(arch, seed), name
    assert [card.id for card in client.models.list().data] == list(MODELS)


def test_32_concurrent_streams_across_both_models_finish(server):
    async def stream(client: openai.AsyncOpenAI, index: int) -> str | None:
        model = list(MODELS)[index % 2]
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
    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    for name in MODELS:
        assert f'paged_backend:generation_tokens_total{{model_name="{name}"}}' in metrics
        assert f'paged_backend:num_requests_running{{model_name="{name}"}}' in metrics


def test_one_models_overload_never_starves_the_others_admission(server):
    """Flood llama far past its 96-block pool; a qwen request is admitted and finishes meanwhile."""

    async def run() -> tuple[float, float]:
        client = server.async_client()
        flood = [asyncio.ensure_future(client.completions.create(model="llama", prompt=PROMPT * 4, max_tokens=48,
                                                                 temperature=0, extra_body={"ignore_eos": True}))
                 for _ in range(24)]  # fmt: skip
        await asyncio.sleep(0.5)
        await client.completions.create(model="qwen", prompt=PROMPT, max_tokens=4, temperature=0)
        qwen_done = asyncio.get_running_loop().time()
        await asyncio.gather(*flood)
        return qwen_done, asyncio.get_running_loop().time()

    qwen_done, flood_done = asyncio.run(run())
    assert qwen_done < flood_done  # answered while llama still worked through its backlog


def test_an_unknown_model_gets_a_404_naming_the_served_ones(server):
    with pytest.raises(openai.NotFoundError) as caught:
        server.client().completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    message = caught.value.body["message"]
    assert "'llama'" in message and "'qwen'" in message
    health = server.health()
    assert health["status"] == "ok" and set(health["models"]) == set(MODELS)
    assert all(model["engine"]["num_running"] == 0 for model in health["models"].values())


def test_a_config_file_lists_models_with_options_and_shares(tmp_path):
    yaml_file, toml_file = tmp_path / "models.yaml", tmp_path / "models.toml"
    yaml_file.write_text("models:\n  - {model: null, served_model_name: a, share: 3, max_num_seqs: 8}\n"
                         "  - {model: null, served_model_name: b}\n")  # fmt: skip
    toml_file.write_text('[[models]]\nserved_model_name = "a"\nshare = 3\nmax_num_seqs = 8\n'
                         '[[models]]\nserved_model_name = "b"\n')  # fmt: skip
    base = EngineConfig(device="cpu", cache={"kv_cache_memory_bytes": 4 << 20})
    for path in (yaml_file, toml_file):
        specs = model_specs(base, [], [], str(path))
        assert [(s.name, s.share, s.config.scheduler.max_num_seqs) for s in specs] == [("a", 3, 8), ("b", 1, 256)]
    engines = build_engines(base, specs)  # one 4 MiB budget split 3:1 between two copies of the embedded model
    blocks = {name: engine.block_manager.num_blocks for name, engine in engines.items()}
    assert blocks["a"] == pytest.approx(3 * blocks["b"], rel=0.02)
    with pytest.raises(InvalidRequest, match="must differ"):
        model_specs(base, ["x", "y"], ["same", "same"], None)
