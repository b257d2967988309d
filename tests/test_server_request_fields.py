"""vLLM's request fields on the OpenAI routes, through the real `openai` client: accepted, and honoured.

A client written for vLLM sends its extensions (`ignore_eos`, `stream_options.continuous_usage_stats`,
`max_completion_tokens`, `stop: null`, ...) and fields this server has never heard of; the first must change the
output as vLLM's do, the second must be ignored with one warning line, never a 400.
"""

from __future__ import annotations

import openai
import pytest

from paged_backend.worker.models import byte_tokenizer
from tests._server_helpers import MODEL, client_fixture, server_fixture

PROMPT = "The paged cache says:"
ABCDE = [ord(letter) for letter in "ABCDE"]  # byte-level tokenizer: one token per ASCII letter


server = server_fixture("--num-blocks", "512", "--max-model-len", "256")


client = client_fixture()


def greedy(client, **kwargs):
    arguments = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    extra = {**arguments.pop("extra_body"), **kwargs.pop("extra_body", {})}
    return client.completions.create(**{**arguments, **kwargs}, extra_body=extra).choices[0]


def test_the_load_generators_chat_body_is_accepted_and_ignore_eos_runs_to_the_limit(client):
    """The exact body of the issue's load generator, which got a 400 on every request before."""
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, max_completion_tokens=20, stop=None,
        extra_body={"ignore_eos": True},
    ))  # fmt: skip
    assert chunks[-1].usage.completion_tokens == 20
    assert [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason] == ["length"]


def test_chat_continuous_usage_stats_put_usage_on_every_chunk(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count."}], stream=True, max_completion_tokens=6,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True},
    ))  # fmt: skip
    assert all(chunk.usage is not None for chunk in chunks)


def test_continuous_usage_stats_put_the_running_usage_on_every_chunk(client):
    chunks = list(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=10, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    ))  # fmt: skip
    counts = [chunk.usage.completion_tokens for chunk in chunks]
    assert all(chunk.usage.prompt_tokens == len(PROMPT) for chunk in chunks)
    assert counts == sorted(counts) and counts[-1] == 10 and counts[0] < 10


def test_unknown_fields_are_ignored_with_one_warning_naming_them(server, client):
    before = server.output().count("frobnicate")
    choice = greedy(client, extra_body={"frobnicate": 1, "stream_options": None, "suffix_style": "x"})
    baseline = greedy(client)
    assert choice.text == baseline.text
    warnings = [line for line in server.output().splitlines() if "frobnicate" in line]
    assert len(warnings) == before + 1
    assert "suffix_style" in warnings[-1]


def test_unknown_keys_inside_known_objects_are_named_with_their_path(server, client):
    list(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, stream=True, stream_options={"include_usage": True, "zork": 1}
    ))  # fmt: skip
    assert "stream_options.zork" in server.output()


def test_ignore_eos_min_tokens_and_max_tokens_bound_the_length(client):
    assert len(byte_tokenizer()(greedy(client, max_tokens=7).text).input_ids) <= 7
    completion = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=9, temperature=0, extra_body={"ignore_eos": True}
    )
    assert completion.usage.completion_tokens == 9 and completion.choices[0].finish_reason == "length"


def test_logit_bias_steers_greedy_output(client):
    forced = greedy(client, logit_bias={str(ord("Z")): 100})
    assert forced.text == "Z" * 12
    as_ids = {"return_tokens_as_token_ids": True}
    first = greedy(client, logprobs=0, extra_body=as_ids).logprobs.tokens[0]  # "token_id:N"
    banned = greedy(client, logprobs=0, logit_bias={first.removeprefix("token_id:"): -100}, extra_body=as_ids)
    assert banned.logprobs.tokens[0] != first


def test_allowed_token_ids_and_bad_words_restrict_the_vocabulary(client):
    allowed = greedy(client, extra_body={"allowed_token_ids": ABCDE})
    assert allowed.text and set(allowed.text) <= set("ABCDE")
    used = allowed.text[0]
    without = greedy(client, extra_body={"allowed_token_ids": ABCDE, "bad_words": [used]})
    assert used not in without.text and set(without.text) <= set("ABCDE")


def test_best_of_returns_the_n_candidates_with_the_highest_cumulative_logprob(client):
    arguments = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=3, logprobs=0,
                     extra_body={"ignore_eos": True})  # fmt: skip
    best = client.completions.create(n=2, best_of=12, **arguments)
    plain = client.completions.create(n=12, **arguments)

    def cumulative(choice):
        return sum(choice.logprobs.token_logprobs)

    ranked = [cumulative(choice) for choice in best.choices]
    assert len(ranked) == 2 and ranked[0] >= ranked[1]
    samples = sorted(cumulative(choice) for choice in plain.choices)
    assert ranked[1] > samples[len(samples) // 2]  # the second best of 12 beats the median of 12 fresh samples
    again = client.completions.create(n=2, best_of=12, **arguments)
    assert [choice.text for choice in again.choices] == [choice.text for choice in best.choices]


def test_seed_n_stop_and_include_stop_str(client):
    letters = {"allowed_token_ids": list(range(ord("A"), ord("Z") + 1))}  # ASCII text, so any slice is a stop
    text = greedy(client, extra_body=letters).text
    stop = text[3:5]
    cut = greedy(client, stop=stop, extra_body=letters)
    kept = greedy(client, stop=stop, extra_body={"include_stop_str_in_output": True, **letters})
    assert cut.text == text[: text.index(stop)] and cut.finish_reason == "stop"
    assert kept.text == text[: text.index(stop)] + stop
    sampled = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7, n=2, user="someone")
    assert [c.text for c in client.completions.create(**sampled).choices] == [
        c.text for c in client.completions.create(**sampled).choices
    ]


def test_truncate_prompt_tokens_keeps_the_last_tokens(client):
    completion = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"truncate_prompt_tokens": 5}
    )
    assert completion.usage.prompt_tokens == 5


def test_request_id_names_the_response_and_priority_is_accepted(server):
    body = {"prompt": PROMPT, "max_tokens": 2, "request_id": "eval-42", "priority": -1}
    first, second = server.post("/v1/completions", json=body), server.post("/v1/completions", json=body)
    assert first.status_code == second.status_code == 200, first.text
    assert first.json()["id"] == second.json()["id"] == "cmpl-eval-42"


def test_chat_takes_the_shared_extensions(client):
    completion = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=5, temperature=0,
        logit_bias={str(ord("Q")): 100}, seed=1, user="u", extra_body={"ignore_eos": True, "min_tokens": 5},
    )  # fmt: skip
    assert completion.choices[0].message.content == "Q" * 5


BAD_BODIES = {
    "logit_bias key not a token id": ({"logit_bias": {"hello": 5}}, "logit_bias"),
    "logit_bias out of range": ({"logit_bias": {"65": 101}}, "logit_bias"),
    "logit_bias token outside the vocabulary": ({"logit_bias": {"100000": 1}}, "logit_bias"),
    "best_of below n": ({"n": 3, "best_of": 2}, "best_of"),
    "best_of streamed": ({"best_of": 3, "stream": True}, "best_of"),
    "bad json schema": (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
        "schema",
    ),
    "json_schema without a schema": ({"response_format": {"type": "json_schema"}}, "json_schema"),
    "two constraints": ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_regex"),
    "wrong type of a known field": ({"ignore_eos": "yes"}, "ignore_eos"),
    "empty allowed_token_ids": ({"allowed_token_ids": []}, "allowed_token_ids"),
}


@pytest.mark.parametrize(("fields", "named"), BAD_BODIES.values(), ids=BAD_BODIES.keys())
def test_bad_extension_values_get_a_400_naming_the_field(server, fields, named):
    response = server.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, **fields})
    assert response.status_code == 400, response.text
    assert named in response.json()["error"]["message"]


def test_the_openai_client_raises_bad_request_for_them(client):
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=MODEL, prompt=PROMPT, n=2, best_of=1)


def test_blocks_return_to_the_pool(server):
    server.wait_until_drained()
