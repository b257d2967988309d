"""vLLM's `--generation-config` / `--override-generation-config` on the servers: the sampling fields a request leaves
out take the model's generation_config.json values (auto), none (vllm), a folder's, with the override over them; a
request's own values win; bad values are refused at start-up naming the flag."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from transformers import GenerationConfig

from paged_backend.engine import Engine, engine_config
from paged_backend.errors import InvalidRequest
from paged_backend.server.app import build_app
from paged_backend.server.state import ServerSettings
from paged_backend.worker.models import SPECIAL_TOKENS, byte_tokenizer, tiny_model

PROMPT = "A paged KV cache keeps each sequence in fixed-size blocks, so "
SET = dict(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.3, max_new_tokens=5)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny model saved with a generation_config.json that sets sampling fields, as instruct models ship."""
    path = tmp_path_factory.mktemp("configured")
    model = tiny_model(seed=5)
    model.generation_config = GenerationConfig(do_sample=True, eos_token_id=SPECIAL_TOKENS["<|eos|>"], **SET)
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def engine(model, **options) -> Engine:
    return Engine(engine_config(model=str(model), device="cpu", num_blocks=64, dtype="float32", **options))


@pytest.fixture(scope="module")
def client(folder):
    with TestClient(build_app(engine(folder), ServerSettings())) as client:
        yield client


def completion(client, **fields) -> dict:
    answer = client.post("/v1/completions", json={"model": client.app.state.server.model_name, "prompt": PROMPT,
                                                  "ignore_eos": True, **fields})  # fmt: skip
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]


def test_fields_left_out_take_the_generation_config(client):
    assert client.app.state.server.sampling_defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20,
                                                         "repetition_penalty": 1.3, "max_tokens": 5}  # fmt: skip
    left_out = completion(client, seed=11)
    spelled = completion(client, seed=11, temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.3, max_tokens=5)
    assert left_out["text"] == spelled["text"] and left_out["finish_reason"] == "length"
    plain = completion(client, seed=11, temperature=1.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, max_tokens=5)
    assert plain["text"] != left_out["text"]  # the defaults did change the draw
    chat = client.post("/v1/chat/completions", json={"model": client.app.state.server.model_name, "seed": 3,
                                                     "messages": [{"role": "user", "content": "Hi"}]})  # fmt: skip
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] <= 5  # max_new_tokens: the default


def test_a_requests_own_values_win(client):
    greedy = completion(client, temperature=0, max_tokens=9)
    again = completion(client, temperature=0, max_tokens=9, seed=99)
    assert greedy["text"] == again["text"] and len(client.app.state.server.tokenizer(greedy["text"]).input_ids) >= 8


def test_vllm_leaves_them_out_and_the_override_goes_over_them(folder):
    assert engine(folder, generation_config="vllm").sampling_defaults == {}
    overridden = engine(folder, override_generation_config='{"temperature": 0, "max_new_tokens": 3}')
    assert overridden.sampling_defaults == {"temperature": 0, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.3,
                                            "max_tokens": 3}  # fmt: skip
    from paged_backend.worker.default_model import TINY_MODEL

    from_folder = engine(TINY_MODEL, generation_config=str(folder))  # another model's folder, read instead
    assert from_folder.sampling_defaults["top_k"] == 20


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"override_generation_config": '{"temprature": 0.5}'}, "unknown field 'temprature'"),
        ({"override_generation_config": '{"temperature": "hot"}'}, "temperature must be a number"),
        ({"override_generation_config": "[1]"}, "must be a JSON object"),
        ({"override_generation_config": '{"top_p": 5}'}, "top_p"),
        ({"generation_config": "/no/such/folder"}, "--generation-config '/no/such/folder' is neither auto, vllm"),
    ],
)
def test_bad_values_are_refused_naming_them(folder, options, said):
    with pytest.raises((InvalidRequest, ValueError), match=said):
        engine(folder, **options)
