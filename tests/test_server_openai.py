"""The OpenAI face through the official `openai` client against a real server process."""

from __future__ import annotations

from tests._server_helpers import MODEL, client_fixture, server_fixture

PROMPT = "The paged cache says:"


server = server_fixture("--num-blocks", "512", "--max-model-len", "512")


client = client_fixture()


def sampled(client, **kwargs):
    """A seeded, sampled completion long enough to carry real text."""
    arguments = dict(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=1.0, seed=11, extra_body={"ignore_eos": True}
    )
    return client.completions.create(**{**arguments, **kwargs})


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [model.id for model in models.data] == [MODEL]
    card = models.data[0].model_dump()  # vLLM's card: the model as loaded, no parent, its context
    assert card["root"] == MODEL and card["parent"] is None and card["max_model_len"] > 0


def test_completion_counts_tokens_and_stops_at_max_tokens(client):
    completion = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    [choice] = completion.choices
    assert choice.finish_reason == "length"
    assert completion.usage.completion_tokens == 8
    assert completion.usage.prompt_tokens == len(PROMPT.encode())  # the embedded tokenizer is byte-level
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 8


def test_same_seed_gives_the_same_text_and_another_seed_does_not(client):
    first, again, other = sampled(client), sampled(client), sampled(client, seed=12)
    assert first.choices[0].text == again.choices[0].text
    assert first.choices[0].text != other.choices[0].text
    assert len(first.choices[0].text) > 5


def test_streamed_completion_equals_non_streamed_for_the_same_seed(client):
    whole = sampled(client)
    chunks = list(sampled(client, stream=True, stream_options={"include_usage": True}))
    text = "".join(choice.text for chunk in chunks for choice in chunk.choices)
    finish = [choice.finish_reason for chunk in chunks for choice in chunk.choices if choice.finish_reason]
    assert text == whole.choices[0].text
    assert finish == ["length"]
    assert chunks[-1].usage.completion_tokens == 24 == whole.usage.completion_tokens
    assert all(chunk.usage is None for chunk in chunks[:-1])


def test_n_choices_are_distinct_and_each_reproducible(client):
    completion = sampled(client, n=3)
    again = sampled(client, n=3)
    texts = [choice.text for choice in completion.choices]
    assert [choice.index for choice in completion.choices] == [0, 1, 2]
    assert texts == [choice.text for choice in again.choices]
    assert len(set(texts)) == 3
    assert completion.usage.completion_tokens == 3 * 24


def test_streamed_n_choices_equal_non_streamed(client):
    whole = sampled(client, n=2)
    texts = {0: "", 1: ""}
    for chunk in sampled(client, n=2, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert [texts[0], texts[1]] == [choice.text for choice in whole.choices]


def test_stop_string_cuts_the_text_before_it(client):
    full = sampled(client).choices[0].text
    stop = full[4:6]
    stopped = sampled(client, stop=[stop]).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == full[: full.index(stop)]


def test_streamed_stop_equals_non_streamed_stop(client):
    stop = sampled(client).choices[0].text[4:6]
    whole = sampled(client, stop=stop).choices[0].text
    streamed = "".join(c.choices[0].text for c in sampled(client, stop=stop, stream=True) if c.choices)
    assert streamed == whole


def test_batch_prompts_give_n_choices_per_prompt_in_order(client):
    completion = sampled(client, prompt=[PROMPT, "Another prompt"], n=2, max_tokens=4)
    assert [choice.index for choice in completion.choices] == [0, 1, 2, 3]
    single = sampled(client, prompt="Another prompt", n=2, max_tokens=4)
    assert [c.text for c in completion.choices[2:]] == [c.text for c in single.choices]


def test_token_id_prompt_equals_text_prompt(client):
    by_text = sampled(client, max_tokens=6)
    by_ids = sampled(client, prompt=list(PROMPT.encode()), max_tokens=6)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_completion_logprobs_cover_every_token(client):
    # as token ids: two byte tokens that are half a character each decode to the same "\ufffd" key
    completion = sampled(client, max_tokens=6, logprobs=2, extra_body={"ignore_eos": True,
                                                                      "return_tokens_as_token_ids": True})
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert all(value <= 0 for value in logprobs.token_logprobs)
    # OpenAI's legacy shape (and vLLM's): the sampled token first, then the 2 most likely: up to 3 items
    assert all(len(top) in (2, 3) and next(iter(top.items())) == (token, value)
               for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs,
                                            strict=True))  # fmt: skip
    assert any(len(top) == 3 for top in logprobs.top_logprobs)  # at temperature 1 a token outside the top 2
    assert logprobs.text_offset[0] == 0


def test_chat_streamed_equals_non_streamed_and_counts_usage(client):
    arguments = dict(model=MODEL, messages=[{"role": "user", "content": "Say something."}], max_tokens=16,
                     temperature=1.0, seed=5, extra_body={"ignore_eos": True})  # fmt: skip
    whole = client.chat.completions.create(**arguments)
    chunks = list(client.chat.completions.create(**arguments, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert whole.choices[0].message.role == "assistant"
    assert streamed == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 16
    assert whole.usage.prompt_tokens > len("Say something.")  # the chat template adds role markers


def test_chat_without_max_tokens_may_use_the_whole_context(client):
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=0, max_completion_tokens=3
    )
    assert chat.usage.completion_tokens <= 3


def test_chat_logprobs_list_top_alternatives(client):
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, logprobs=True, top_logprobs=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    assert all(len(token.top_logprobs) == 3 for token in content)


def test_metrics_use_vllm_names_and_count_the_traffic(server, client):
    sampled(client, max_tokens=4)
    metrics = server.wait_until_drained()
    for name in ("num_requests_running", "num_requests_waiting", "num_requests_swapped", "kv_cache_usage_perc",
                 "num_preemptions_total", "prefix_cache_queries_total", "prefix_cache_hits_total"):  # fmt: skip
        assert f"paged_backend:{name}" in metrics
    assert metrics["paged_backend:num_requests_swapped"] == 0  # drained
    assert metrics["paged_backend:prompt_tokens_total"] > 0
    assert metrics["paged_backend:generation_tokens_total"] >= 4
    for histogram in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert metrics[f"paged_backend:{histogram}_count"] > 0


def test_health_reports_the_engine_state(server):
    health = server.health()
    assert health["status"] == "ok"
    assert {"num_running", "num_waiting", "kv_usage"} <= set(health["engine"])


def beam_search(client, **kwargs):
    arguments = dict(model=MODEL, prompt=PROMPT, max_tokens=8, n=3, temperature=0,
                     extra_body={"use_beam_search": True, "ignore_eos": True})  # fmt: skip
    return client.completions.create(**{**arguments, **kwargs})


def test_beam_search_gives_the_engines_beams_best_first(client):
    """vLLM's use_beam_search: n is the beam width, the n beams come back best first, the same as in-process."""
    from paged_backend import LLM, SamplingParams

    completion = beam_search(client)
    texts = [choice.text for choice in completion.choices]
    llm = LLM(MODEL, device="cpu", num_blocks=64)
    [expected] = llm.generate(PROMPT, SamplingParams(n=3, max_tokens=8, use_beam_search=True, ignore_eos=True))
    assert texts == [beam.text for beam in expected.outputs]
    assert len(set(texts)) == 3 and completion.usage.completion_tokens == 24
    streamed = {0: "", 1: "", 2: ""}
    for chunk in beam_search(client, stream=True):  # the search reports at its end: one piece per beam
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert list(streamed.values()) == texts
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                          n=2, extra_body={"use_beam_search": True, "ignore_eos": True})  # fmt: skip
    assert [choice.index for choice in chat.choices] == [0, 1] and chat.usage.completion_tokens == 12


def test_beam_search_refuses_a_sampling_field(server):
    response = server.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "n": 2, "top_p": 0.5,
                                                    "use_beam_search": True})  # fmt: skip
    assert response.status_code == 400
    assert "top_p" in response.json()["error"]["message"]
