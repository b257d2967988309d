"""TGI's remaining parameters through the real clients on every backend: decoder_input_details, typical_p, watermark,
grammar, and tools on the chat route.

`text_generation.Client` posts to `/generate`; `huggingface_hub.InferenceClient.text_generation` to `/`.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re

import httpx
import jsonschema
import pytest
import torch
from huggingface_hub import InferenceClient
from text_generation import Client
from text_generation.errors import ValidationError
from text_generation.types import Grammar, GrammarType

from paged_backend.engine.watermark import watermark_z_score
from paged_backend.worker.models import embedded_model
from tests._tgi_helpers import BACKENDS, every_backend

SHARD_BLOCKS = 257
# Room for tool prompts (the byte tokenizer spends a token per character) within the model's 1024 positions.
LIMITS = ["--max-total-tokens", "1024", "--max-input-tokens", "900", "--max-batch-prefill-tokens", "1024"]
PROMPT = "The quick brown fox jumps"  # 25 tokens: one full block, so a repeat hits the paged prefix cache
GRAMMAR_BACKENDS = ("paged", "grpc")
needs_grammar_engine = pytest.mark.skipif(
    importlib.util.find_spec("paged_backend.structured.manager") is None,
    reason="the structured-output engine (paged_backend.structured.manager) is not in this tree yet",
)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer", "minimum": 1, "maximum": 30}},
            "required": ["city", "days"],
        },
    },
}
CLOCK_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def servers():
    # float32 on every backend (`--dtype auto` is bfloat16 on CPUs with AMX or AVX512-BF16): prompt logprobs are held
    # to an HF float32 forward within 1e-4, and top_k=1 tokens to greedy ones, which exact bfloat16 logit ties split
    with every_backend(SHARD_BLOCKS, LIMITS, dtype="float32") as started:
        yield started
        for backend in ("paged", "grpc"):  # every KV block is free again once the module's requests ended
            started[backend].wait_until_drained()


@pytest.fixture(scope="module")
def hf_model():
    model, _ = embedded_model(torch.float32)
    return model.eval()


def hf_prompt_logprobs(model, ids: list[int]) -> list[float]:
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    return logprobs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


@pytest.mark.parametrize("backend", BACKENDS)
def test_decoder_input_details_match_an_hf_forward(servers, hf_model, backend):
    url = servers[backend].url
    for _ in range(2):  # the repeat reads a cached prefix on the paged backend: values must not change
        prefill = Client(url, timeout=120).generate(PROMPT, max_new_tokens=2, decoder_input_details=True).details.prefill
        ids = [token.id for token in prefill]
        assert "".join(token.text for token in prefill) == PROMPT and prefill[0].logprob is None
        expected = hf_prompt_logprobs(hf_model, ids)
        assert max(abs(token.logprob - value) for token, value in zip(prefill[1:], expected, strict=True)) < 1e-4
    hub = InferenceClient(model=url, timeout=120).text_generation(
        PROMPT, max_new_tokens=2, decoder_input_details=True, details=True
    )
    assert [token.id for token in hub.details.prefill] == ids
    assert hub.details.prefill[0].logprob is None
    assert max(abs(token.logprob - value) for token, value in zip(hub.details.prefill[1:], expected, strict=True)) < 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
def test_typical_p_is_seeded_and_leaves_a_single_candidate_alone(servers, backend):
    client = Client(servers[backend].url, timeout=120)
    hub = InferenceClient(model=servers[backend].url, timeout=120)

    def tokens(**parameters) -> list[int]:
        return [token.id for token in client.generate(PROMPT, max_new_tokens=16, **parameters).details.tokens]

    typical = tokens(typical_p=0.3, seed=11)
    assert typical == tokens(typical_p=0.3, seed=11)  # reproducible
    text = hub.text_generation(PROMPT, max_new_tokens=16, typical_p=0.3, seed=11, return_full_text=False)
    assert text == client.generate(PROMPT, max_new_tokens=16, typical_p=0.3, seed=11).generated_text
    assert typical != tokens(do_sample=True, seed=11)  # the warper changes what is drawn
    # With one candidate left (top_k=1), typical decoding has nothing to choose: the greedy tokens come back.
    assert tokens(typical_p=0.3, top_k=1, seed=11) == tokens()


def pooled_z_score(sequences: list[list[int]], vocab_size: int) -> float:
    """One z-score over several sequences: each z_i scores n_i tokens, so the pooled count gives sum(z_i sqrt(n_i))."""
    scored = [len(ids) - 1 for ids in sequences]
    total = sum(watermark_z_score(ids, vocab_size) * math.sqrt(n) for ids, n in zip(sequences, scored, strict=True))
    return total / math.sqrt(sum(scored))


@pytest.mark.parametrize("backend", BACKENDS)
def test_watermark_z_score_separates_marked_from_plain_text(servers, backend):
    client = Client(servers[backend].url, timeout=120)

    def sample(watermark: bool) -> list[list[int]]:
        sequences, seed = [], 0
        while sum(len(ids) - 1 for ids in sequences) < 300:
            response = client.generate(PROMPT, max_new_tokens=160, do_sample=True, seed=seed, watermark=watermark)
            sequences.append([token.id for token in response.details.tokens])
            seed += 1
        return sequences

    marked, plain = pooled_z_score(sample(True), 256), pooled_z_score(sample(False), 256)
    assert marked > 4 and abs(plain) < 2, (marked, plain)
    hub = InferenceClient(model=servers[backend].url, timeout=120)
    via_hub = hub.text_generation(PROMPT, max_new_tokens=16, do_sample=True, seed=0, watermark=True, details=True)
    expected = client.generate(PROMPT, max_new_tokens=16, do_sample=True, seed=0, watermark=True)
    assert [token.id for token in via_hub.details.tokens] == [token.id for token in expected.details.tokens]


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_grammars_are_422_naming_the_problem(servers, backend):
    client = Client(servers[backend].url, timeout=120)
    with pytest.raises(ValidationError, match="grammar is not valid: `value` is not JSON"):
        client.generate(PROMPT, max_new_tokens=4, grammar=Grammar(type=GrammarType.Json, value="{not json"))
    response = httpx.post(
        f"{servers[backend].url}/generate",
        json={"inputs": PROMPT, "parameters": {"grammar": {"type": "json", "value": {"type": "nonsense"}}}},
        timeout=60,
    )
    assert response.status_code == 422 and response.json()["error_type"] == "validation"
    assert "grammar is not valid: 'nonsense' is not valid" in response.json()["error"]


def test_the_reference_backend_refuses_grammars_plainly(servers):
    with pytest.raises(ValidationError, match="grammar is not supported by the reference backend"):
        Client(servers["reference"].url).generate(PROMPT, grammar=Grammar(type=GrammarType.Regex, value="a+"))


@pytest.mark.parametrize("backend", GRAMMAR_BACKENDS)
def test_tool_choice_errors_are_tool_errors(servers, backend):
    url = f"{servers[backend].url}/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "weather?"}], "max_tokens": 8}
    missing = httpx.post(url, json={**body, "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert missing.status_code == 422 and missing.json()["error_type"] == "tool_error"
    assert "Tool with name nope not found" in missing.json()["error"]
    nameless = httpx.post(url, json={**body, "tools": [{"type": "function", "function": {"parameters": {}}}]})
    assert nameless.status_code == 422 and "tools[0].function.name" in nameless.json()["error"]
    both = httpx.post(url, json={**body, "tools": [WEATHER_TOOL], "response_format": {"type": "json_object"}})
    assert both.status_code == 422 and "either `tools` or `response_format`" in both.json()["error"]


@needs_grammar_engine
@pytest.mark.parametrize("backend", GRAMMAR_BACKENDS)
def test_grammar_output_validates(servers, backend):
    client = Client(servers[backend].url, timeout=120)
    hub = InferenceClient(model=servers[backend].url, timeout=120)
    for seed in range(3):
        text = client.generate(
            PROMPT, max_new_tokens=400, do_sample=True, seed=seed, grammar=Grammar(type=GrammarType.Json, value=PERSON)
        ).generated_text
        jsonschema.validate(json.loads(text), PERSON)
        pattern = r"[a-c]{2,4}-[0-9]{3}"
        text = hub.text_generation(
            PROMPT, max_new_tokens=30, do_sample=True, seed=seed, return_full_text=False,
            grammar={"type": "regex", "value": pattern},
        )  # fmt: skip
        assert re.fullmatch(pattern, text), text
    with pytest.raises(ValidationError, match="grammar is not valid"):
        client.generate(PROMPT, max_new_tokens=4, grammar=Grammar(type=GrammarType.Regex, value="(unclosed"))


@needs_grammar_engine
@pytest.mark.parametrize("backend", GRAMMAR_BACKENDS)
def test_tools_come_back_as_calls_that_validate(servers, backend):
    hub = InferenceClient(model=servers[backend].url, timeout=120)
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    parameters = WEATHER_TOOL["function"]["parameters"]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        reply = hub.chat_completion(messages, tools=[WEATHER_TOOL, CLOCK_TOOL], tool_choice=choice, max_tokens=120, seed=1)
        call = reply.choices[0].message.tool_calls[0]
        assert reply.choices[0].finish_reason == "tool_calls"
        if choice != "required":
            assert call.function.name == "get_weather"
        if call.function.name == "get_weather":
            jsonschema.validate(json.loads(call.function.arguments), parameters)
    chunks = list(
        hub.chat_completion(messages, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=120, stream=True, seed=1)
    )
    calls = [call for chunk in chunks if chunk.choices for call in chunk.choices[0].delta.tool_calls or []]
    assert calls and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads("".join(call.function.arguments for call in calls)), parameters)
    auto = hub.chat_completion(messages, tools=[WEATHER_TOOL], max_tokens=120, seed=1).choices[0].message
    assert (auto.content is not None) != bool(auto.tool_calls)  # a call, or no_tool's plain answer
    shaped = hub.chat_completion(
        messages, max_tokens=120, seed=1, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    )
    jsonschema.validate(json.loads(shaped.choices[0].message.content), PERSON)
