"""vLLM's chat extensions and message shapes on /v1/chat/completions, through the real `openai` client.

The server loads a tiny model whose chat template prints tools, tool calls, tool results and documents, so what
the template received can be checked: the server's prompt must be exactly the text the template makes of the
messages as written here (same token count, and the same greedy continuation as that text sent as a raw prompt).
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pydantic
import pytest

from paged_backend.worker.models import byte_tokenizer, tiny_model
from tests._server_helpers import API_KEY, MODEL, client_fixture, running_server

ALIAS = "the-same-model"  # a second --served-model-name for the one model

# transformers renders templates with trim_blocks, which eats a newline right after a block tag: hence {{ '\\n' }}.
TEMPLATE = (
    "{% if greeting %}{{ greeting }}\n{% endif %}"
    "{% for tool in tools or [] %}<|bos|>tool {{ tool.function.name }}: {{ tool.function.parameters | tojson }}\n"
    "{% endfor %}"
    "{% for document in documents or [] %}<|bos|>document {{ document.title }}: {{ document.text }}\n{% endfor %}"
    "{% for message in messages %}<|bos|>{{ message.role }}"
    "{% if message.tool_call_id %} [{{ message.tool_call_id }}]{% endif %}{{ '\\n' }}{{ message.content }}"
    "{% for call in message.tool_calls or [] %}<call {{ call.id }}>{{ call.function.name }} "
    "{{ call.function.arguments | tojson }}</call>{% endfor %}<|eos|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CONVERSATION = [
    {"role": "developer", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Paris?"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call-1", "content": "sunny, 21 C"},
]  # fmt: skip
# What the template must print for CONVERSATION with WEATHER_TOOL, written out by hand.
RENDERED = (
    '<|bos|>tool get_weather: {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}\n'
    "<|bos|>developer\nBe brief.<|eos|>\n"
    "<|bos|>user\nWeather\nin Paris?<|eos|>\n"
    '<|bos|>assistant\n<call call-1>get_weather {"city": "Paris"}</call><|eos|>\n'
    "<|bos|>tool [call-1]\nsunny, 21 C<|eos|>\n"
    "<|bos|>assistant\n"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """TEMPLATE as the server's `--chat-template` file (the tokenizer keeps its own), request templates trusted,
    and the model under two names, given as vLLM's `--served-model-name A B`."""
    model_dir = tmp_path_factory.mktemp("tools-template-model")
    tiny_model(seed=3).save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    template_file = model_dir / "tools.jinja"
    template_file.write_text(TEMPLATE)
    with running_server("--model", str(model_dir), "--served-model-name", MODEL, ALIAS, "--num-blocks", "256",
                        "--max-model-len", "512", "--chat-template", str(template_file),
                        "--trust-request-chat-template") as server:  # fmt: skip
        yield server


client = client_fixture()


def test_every_served_name_is_listed_and_taken_and_answers_give_the_first(client):
    assert [model.id for model in client.models.list().data] == [MODEL, ALIAS]
    hello = [{"role": "user", "content": "hi"}]
    by_alias = greedy_chat(client, hello, model=ALIAS)
    assert by_alias.model == MODEL  # vLLM's rule: the first name is the one answers give
    assert by_alias.choices[0].message.content == greedy_chat(client, hello).choices[0].message.content
    with pytest.raises(openai.NotFoundError, match=f"serves '{MODEL}', '{ALIAS}'"):
        greedy_chat(client, hello, model="not-served")


def prompt_tokens(text: str) -> list[int]:
    return byte_tokenizer()(text, add_special_tokens=False).input_ids


def greedy_chat(client, messages, **kwargs):
    arguments = dict(model=MODEL, messages=messages, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    return client.chat.completions.create(**{**arguments, **kwargs})


def greedy_text(client, prompt: str) -> str:
    completion = client.completions.create(
        model=MODEL, prompt=prompt_tokens(prompt), max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    return completion.choices[0].text


def test_tools_tool_calls_and_tool_results_render_through_the_template(client):
    chat = greedy_chat(client, CONVERSATION, tools=[WEATHER_TOOL], tool_choice="none")
    assert chat.usage.prompt_tokens == len(prompt_tokens(RENDERED))
    assert chat.choices[0].message.content == greedy_text(client, RENDERED)
    assert chat.choices[0].message.tool_calls is None and chat.choices[0].finish_reason == "length"


def test_chat_template_and_its_kwargs_come_from_the_request(client):
    template = "{{ greeting }}|{% for message in messages %}{{ message.content }}|{% endfor %}"
    messages = [{"role": "user", "content": "hi"}]
    chat = greedy_chat(client, messages, extra_body={"ignore_eos": True, "chat_template": template,
                                                     "chat_template_kwargs": {"greeting": "Hello"}})  # fmt: skip
    assert chat.usage.prompt_tokens == len("Hello|hi|")
    assert chat.choices[0].message.content == greedy_text(client, "Hello|hi|")


def test_documents_reach_the_template(client):
    documents = [{"title": "A", "text": "alpha"}]
    chat = greedy_chat(client, [{"role": "user", "content": "hi"}],
                       extra_body={"ignore_eos": True, "documents": documents})  # fmt: skip
    expected = "<|bos|>document A: alpha\n<|bos|>user\nhi<|eos|>\n<|bos|>assistant\n"
    assert chat.usage.prompt_tokens == len(prompt_tokens(expected))


CONTINUED = [{"role": "user", "content": "Count:"}, {"role": "assistant", "content": "one two"}]
CONTINUE = {"ignore_eos": True, "add_generation_prompt": False, "continue_final_message": True}


def test_continue_final_message_extends_the_last_turn_and_echo_repeats_it(client):
    open_turn = "<|bos|>user\nCount:<|eos|>\n<|bos|>assistant\none two"  # no end-of-turn after the last message
    plain = greedy_chat(client, CONTINUED, extra_body=CONTINUE)
    echoed = greedy_chat(client, CONTINUED, extra_body={**CONTINUE, "echo": True})
    assert plain.usage.prompt_tokens == len(prompt_tokens(open_turn))
    assert plain.choices[0].message.content == greedy_text(client, open_turn)
    assert echoed.choices[0].message.content == "one two" + plain.choices[0].message.content
    chunks = list(greedy_chat(client, CONTINUED, extra_body={**CONTINUE, "echo": True}, stream=True))
    assert chunks[0].choices[0].delta.content.startswith("one two")
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == echoed.choices[0].message.content


def test_echo_without_a_turn_to_continue_adds_nothing(client):
    messages = [{"role": "user", "content": "hi"}]
    assert (greedy_chat(client, messages, extra_body={"ignore_eos": True, "echo": True}).choices[0].message.content
            == greedy_chat(client, messages).choices[0].message.content)  # fmt: skip


def test_chat_streams_usage_on_every_chunk_under_the_clients_request_id(client):
    chunks = list(greedy_chat(client, [{"role": "user", "content": "hi"}], stream=True,
                              stream_options={"include_usage": True, "continuous_usage_stats": True},
                              extra_body={"ignore_eos": True, "request_id": "eval-7"}))  # fmt: skip
    assert {chunk.id for chunk in chunks} == {"chatcmpl-eval-7"}
    generated = [chunk.usage.completion_tokens for chunk in chunks]
    assert generated == sorted(generated) and generated[-1] == 12 and len(set(generated)) > 2


def test_chat_prompt_logprobs_and_token_id_logprobs(client, server):
    chat = greedy_chat(
        client,
        [{"role": "user", "content": "hi"}],
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True, "prompt_logprobs": 1, "return_tokens_as_token_ids": True},
    )
    rendered = prompt_tokens("<|bos|>user\nhi<|eos|>\n<|bos|>assistant\n")
    prompt_logprobs = chat.model_extra["prompt_logprobs"]
    assert len(prompt_logprobs) == len(rendered) and prompt_logprobs[0] is None
    assert all(str(token) in entry for token, entry in zip(rendered[1:], prompt_logprobs[1:], strict=True))
    assert all(re.fullmatch(r"token_id:\d+", token.token) for token in chat.choices[0].logprobs.content)
    streamed = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "prompt_logprobs": 1}
    assert "prompt_logprobs" in server.post("/v1/chat/completions", json=streamed).json()["error"]["message"]


class Answer(pydantic.BaseModel):
    verdict: bool
    score: int


def test_parse_with_a_pydantic_response_format_returns_the_object(client):
    chat = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Judge."}], response_format=Answer, max_tokens=64, seed=1
    )
    assert isinstance(chat.choices[0].message.parsed, Answer)


BAD = {
    "both generation prompt and continuation": (
        {"messages": CONTINUED, "add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
    "template syntax error": ({"messages": CONTINUED, "chat_template": "{% for %}"}, "chat template"),
    "template raises": ({"messages": CONTINUED, "chat_template": "{{ raise_exception('no tools here') }}"},
                        "no tools here"),
    "template renders nothing": ({"messages": CONTINUED, "chat_template": "{# nothing #}"}, "empty text"),
    "template renders more than the context holds": (
        {"messages": CONTINUED, "chat_template": "{{ 'x' * 30000000 }}"}, "characters, more than max_model_len"),
    "kwargs override an argument": (
        {"messages": CONTINUED, "chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    "image part": ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
                   "messages.0.user.content"),
    "lone surrogate in content": ({"messages": [{"role": "user", "content": "\ud800"}]}, "Unicode"),
    "tool message without its call id": ({"messages": [{"role": "tool", "content": "21 C"}]}, "tool_call_id"),
    "auto tool choice without the server flag": (
        {"messages": CONTINUED, "tools": [WEATHER_TOOL], "tool_choice": "auto"}, "--enable-auto-tool-choice"),
    "tools default to auto, which needs the flag": (
        {"messages": CONTINUED, "tools": [WEATHER_TOOL]}, "--enable-auto-tool-choice"),
}  # fmt: skip


@pytest.mark.parametrize("body, named", BAD.values(), ids=BAD.keys())
def test_malformed_chat_requests_get_a_400_naming_the_problem(server, body, named):
    encoded = json.dumps(body).encode()  # ASCII with \u escapes: a lone surrogate survives the trip
    response = server.post("/v1/chat/completions", content=encoded, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert named in response.json()["error"]["message"]


def test_a_slow_chat_template_does_not_hold_up_the_server(server):
    """A request's own template renders on a worker thread: the event loop answers others meanwhile."""
    slow = {"messages": CONTINUED, "max_tokens": 1,
            "chat_template": "{% for i in range(8000) %}{% for j in range(8000) %}{% endfor %}{% endfor %}hi"}  # fmt: skip
    with ThreadPoolExecutor(1) as pool:
        rendering = pool.submit(server.post, "/v1/chat/completions", json=slow)
        time.sleep(0.5)
        started = time.perf_counter()
        server.health()
        waited = time.perf_counter() - started
        assert not rendering.done(), "the template rendered too fast to tell"
        assert waited < 0.5, f"/health waited {waited:.2f} s behind the template"
        assert rendering.result().status_code == 200  # ~1.5 s of loops, then "hi"


def test_the_openai_client_sees_bad_chat_input_as_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="tool_call_id"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "tool", "content": "x"}])


def test_every_block_is_free_afterwards(server):
    server.wait_until_drained()


def test_browsers_get_cors_as_from_vllm_and_a_preflight_needs_no_key(server):
    preflight = httpx.options(f"{server.url}/v1/chat/completions", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})  # fmt: skip
    assert preflight.status_code == 200, preflight.text  # was 401: the key check ran first
    assert preflight.headers["access-control-allow-origin"] == "*"
    listed = httpx.get(f"{server.url}/v1/models", headers={"Origin": "https://app.example", "Authorization": f"Bearer {API_KEY}"})
    assert listed.status_code == 200 and listed.headers["access-control-allow-origin"] == "*"
