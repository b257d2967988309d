"""Several models behind one `serve --config`: routing by `model` (the Qwen2 model's peft adapters included),
each equal to its HF / peft generate, 32 concurrent streams across both, one model's overload not starving the
other, a 404 naming the served models, per-model /health and /metrics; config files and the KV split."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from _lora_helpers import PROMPTS, expected_tokens, save_base_and_adapters
from _server_helpers import running_server

from paged_backend.config import EngineConfig
from paged_backend.errors import InvalidRequest
from paged_backend.lora.request import parse_lora_modules
from paged_backend.models import byte_tokenizer, tiny_model
from paged_backend.server.multi_model import build_engines, model_specs

MODELS = {"llama": ("llama", 5), "qwen": ("qwen2", 3)}  # served name: (architecture, seed)
PROMPT = [5, 17, 99, 3, 42, 7, 250, 11]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """The Qwen2 model's directory, its three adapters and peft's tokens for each."""
    model_dir, adapters = save_base_and_adapters("qwen2", tmp_path_factory.mktemp("qwen"), seed=3)
    return model_dir, adapters, expected_tokens("qwen2", adapters, MAX_TOKENS)


@pytest.fixture(scope="module")
def server(tmp_path_factory, qwen):
    llama_dir = tmp_path_factory.mktemp("llama")
    tiny_model("llama", seed=5).save_pretrained(llama_dir)
    byte_tokenizer().save_pretrained(llama_dir)
    qwen_dir, adapters, _ = qwen
    modules = "".join(f"\n      qwen-{name}: {path}" for name, path in adapters.items())
    config = tmp_path_factory.mktemp("config") / "models.yaml"
    config.write_text(f"""models:
  - model: {llama_dir}
    served_model_name: llama
  - model: {qwen_dir}
    served_model_name: qwen
    enable_lora: true
    max_loras: 2
    max_lora_rank: 8
    lora_modules:{modules}
""")
    with running_server("--config", str(config), "--num-blocks", "96", "--block-size", "4") as running:
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
    cards = {card.id: getattr(card, "parent", None) for card in client.models.list().data}
    assert cards == {"llama": None, "qwen": None, "qwen-attn4": "qwen", "qwen-all8": "qwen", "qwen-mlp2": "qwen"}


def test_qwen_adapters_mixed_with_both_base_models_equal_peft(server, qwen):
    _, adapters, expected = qwen
    client = server.client()
    jobs = [(name, index) for name in ["qwen", *(f"qwen-{a}" for a in adapters), "llama"] for index in range(2)]

    def tokens(job):
        completion = client.completions.create(
            model=job[0], prompt=PROMPTS[job[1]], max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
            extra_body={"return_tokens_as_token_ids": True},
        )  # fmt: skip
        return [int(t.removeprefix("token_id:")) for t in completion.choices[0].logprobs.tokens]

    with ThreadPoolExecutor(len(jobs)) as pool:  # concurrent: qwen's steps mix its adapters (max_loras=2 of 3)
        results = list(pool.map(tokens, jobs))
    for (name, index), got in zip(jobs, results, strict=True):
        if name != "llama":
            assert got == expected[None if name == "qwen" else name.removeprefix("qwen-")][index], name


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
    flags = model_specs(base, ["/m/a", "/m/b"], ["a", "b"], None)  # --model A --model B --served-model-name ...
    assert [(s.name, s.config.model, s.share) for s in flags] == [("a", "/m/a", 1.0), ("b", "/m/b", 1.0)]
    with pytest.raises(InvalidRequest, match="must differ"):
        model_specs(base, ["x", "y"], ["same", "same"], None)
    with pytest.raises(InvalidRequest, match="one per model"):
        model_specs(base, ["x", "y"], ["only-one"], None)


def test_lora_modules_flag_forms():
    assert parse_lora_modules(["sql=/a/sql", '{"name": "chat", "path": "/a/chat"}']) == {
        "sql": "/a/sql", "chat": "/a/chat"}  # fmt: skip
    for bad in ("no-equals", '{"name": "x"}'):
        with pytest.raises(InvalidRequest, match="--lora-modules"):
            parse_lora_modules([bad])
