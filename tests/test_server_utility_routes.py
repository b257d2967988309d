"""vLLM's utility routes: POST /tokenize (prompt or chat messages), POST /detokenize, GET /version."""

from __future__ import annotations

import httpx
import pytest

from paged_backend import __version__
from paged_backend.worker.models import byte_tokenizer
from tests._server_helpers import MODEL, server_fixture

MAX_MODEL_LEN = 128
MESSAGES = [{"role": "user", "content": "Hello"}]


server = server_fixture("--num-blocks", "64", "--max-model-len", str(MAX_MODEL_LEN))


def test_tokenize_a_prompt_in_vllms_shape(server):
    response = server.post("/tokenize", json={"model": MODEL, "prompt": "Hi!", "return_token_strs": True})
    assert response.json() == {"count": 3, "max_model_len": MAX_MODEL_LEN, "tokens": [72, 105, 33],
                               "token_strs": ["H", "i", "!"]}  # fmt: skip
    assert server.post("/tokenize", json={"prompt": "Hi!"}).json()["token_strs"] is None


def test_tokenized_messages_are_the_prompt_chat_completions_runs(server):
    tokens = server.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    tokenizer = byte_tokenizer()
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert tokens == tokenizer(rendered, add_special_tokens=False).input_ids
    usage = server.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1).usage
    assert usage.prompt_tokens == len(tokens)
    without_prompt = server.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert without_prompt["count"] < len(tokens)


def test_detokenize_inverts_tokenize(server):
    tokens = server.post("/tokenize", json={"prompt": "paged attention"}).json()["tokens"]
    assert server.post("/detokenize", json={"tokens": tokens}).json() == {"prompt": "paged attention"}


def test_version(server):
    assert httpx.get(f"{server.url}/version").json() == {"version": __version__}


@pytest.mark.parametrize(
    ("path", "body", "named"),
    [("/tokenize", {}, "'prompt' or 'messages'"), ("/tokenize", {"prompt": ""}, "prompt"),
     ("/detokenize", {"tokens": [1, 100000]}, "tokens"), ("/detokenize", {"tokens": "abc"}, "tokens"),
     ("/tokenize", {"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id")],
    ids=["neither prompt nor messages", "empty prompt", "token outside the vocabulary", "tokens not a list",
         "tool message without its call id"],
)  # fmt: skip
def test_bad_bodies_get_a_400_naming_the_problem(server, path, body, named):
    response = server.post(path, json=body)
    assert response.status_code == 400, response.text
    assert named in response.json()["error"]["message"]


def test_unknown_model_is_a_404(server):
    assert server.post("/tokenize", json={"model": "other", "prompt": "x"}).status_code == 404
