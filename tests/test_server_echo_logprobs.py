"""/v1/completions `echo` and vLLM's `prompt_logprobs`, checked against a full HF forward of the same model.

The server runs the embedded tiny model in fp32 (`--dtype float32`: auto is bfloat16 on CPUs with AMX or
AVX512-BF16); the test builds the same model in-process and compares every prompt token's logprob, and the top
alternatives, with `model(input_ids).logits.log_softmax(-1)` within 1e-4.
Requests go through the real `openai` client the way lm-evaluation-harness scores multiple-choice tasks: token-id
prompts in a batch, `echo=True`, `logprobs=1`, `max_tokens` 0 or 1.
"""

from __future__ import annotations

import math

import pytest
import torch

from paged_backend.worker.models import embedded_model
from tests._server_helpers import MODEL, client_fixture, server_fixture

TOLERANCE = 1e-4
# Two prompts sharing their first 40 tokens (more than two 16-token blocks), so the second can hit the prefix cache.
SHARED = list(range(40, 80))
PROMPTS = [SHARED + [10, 11, 12, 13], SHARED + [20, 21, 22]]
TEXT_PROMPT = "Paged attention keeps the KV cache in blocks."


server = server_fixture("--dtype", "float32", "--num-blocks", "256", "--max-model-len", "256")


client = client_fixture()


@pytest.fixture(scope="module")
def reference():
    """Token ids -> the HF model's log_softmax over the vocabulary at every position (fp32)."""
    model, tokenizer = embedded_model(torch.float32)

    def log_softmax(token_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)

    log_softmax.tokenizer = tokenizer
    return log_softmax


def assert_matches_reference(token_ids, token_logprobs, reference):
    """Prompt token i's logprob is log_softmax at position i - 1; the first has none."""
    expected = reference(token_ids)
    assert token_logprobs[0] is None
    for position in range(1, len(token_ids)):
        want = expected[position - 1, token_ids[position]].item()
        assert abs(token_logprobs[position] - want) < TOLERANCE, (position, token_logprobs[position], want)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_token_id_prompts_echo_their_logprobs_like_an_hf_forward(client, reference, max_tokens):
    completion = client.completions.create(
        model=MODEL, prompt=PROMPTS, echo=True, logprobs=1, max_tokens=max_tokens, temperature=0
    )
    assert [choice.index for choice in completion.choices] == [0, 1]
    for prompt, choice in zip(PROMPTS, completion.choices, strict=True):
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(prompt) + max_tokens
        assert_matches_reference(prompt, logprobs.token_logprobs[: len(prompt)], reference)
        # the prompt token first, then the top-1 alternative: the argmax of the distribution that scored it
        expected = reference(prompt)
        for position in range(1, len(prompt)):
            top = logprobs.top_logprobs[position]
            first, *rest = top.items()
            assert first == (logprobs.tokens[position], logprobs.token_logprobs[position])
            best_id = int(expected[position - 1].argmax())
            best = reference.tokenizer.decode([best_id])
            assert len(top) == (1 if best_id == prompt[position] else 2), top
            assert abs(top[best] - expected[position - 1].max().item()) < TOLERANCE
        assert logprobs.top_logprobs[0] is None
        assert choice.finish_reason == "length"
        assert choice.text.startswith(reference.tokenizer.decode(prompt))
    assert completion.usage.completion_tokens == 2 * max_tokens


def test_the_generated_token_follows_the_echoed_prompt(client, reference):
    [choice] = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], echo=True, logprobs=1, max_tokens=1, temperature=0
    ).choices
    greedy = int(reference(PROMPTS[0])[-1].argmax())
    assert choice.logprobs.tokens[-1] == reference.tokenizer.decode([greedy])
    assert abs(choice.logprobs.token_logprobs[-1] - reference(PROMPTS[0])[-1].max().item()) < TOLERANCE


def test_a_prompt_in_the_prefix_cache_still_gets_full_prompt_logprobs(server, client, reference):
    """Run a prompt to fill the prefix cache, then score it: the cached blocks have no logits to read."""
    client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=1, temperature=0)
    for _ in range(2):
        [choice] = client.completions.create(
            model=MODEL, prompt=PROMPTS[1], echo=True, logprobs=1, max_tokens=0
        ).choices
        assert_matches_reference(PROMPTS[1], choice.logprobs.token_logprobs, reference)
    server.wait_until_drained()


def test_text_prompt_echo_returns_the_prompt_text_and_offsets(client, reference):
    [choice] = client.completions.create(
        model=MODEL, prompt=TEXT_PROMPT, echo=True, logprobs=0, max_tokens=4, temperature=0,
        extra_body={"ignore_eos": True},
    ).choices  # fmt: skip
    token_ids = reference.tokenizer(TEXT_PROMPT).input_ids
    logprobs = choice.logprobs
    assert choice.text.startswith(TEXT_PROMPT)
    assert len(logprobs.tokens) == len(token_ids) + 4
    assert_matches_reference(token_ids, logprobs.token_logprobs[: len(token_ids)], reference)
    assert logprobs.text_offset[: len(token_ids)] == list(range(len(token_ids)))  # one byte per token
    assert logprobs.text_offset[len(token_ids)] == len(TEXT_PROMPT)


def test_vllm_prompt_logprobs_field_holds_the_prompt_token_and_top_k(server, reference):
    prompt, top = PROMPTS[0], 3
    response = server.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "prompt_logprobs": top})
    assert response.status_code == 200, response.text
    [choice] = response.json()["choices"]
    entries = choice["prompt_logprobs"]
    expected = reference(prompt)
    assert entries[0] is None and len(entries) == len(prompt)
    for position in range(1, len(prompt)):
        row = expected[position - 1]
        values, alternatives = row.topk(top)
        entry = entries[position]
        wanted = {prompt[position], *alternatives.tolist()}
        assert {int(token) for token in entry} == wanted
        for rank, (token, value) in enumerate(zip(alternatives.tolist(), values.tolist(), strict=True), start=1):
            assert abs(entry[str(token)]["logprob"] - value) < TOLERANCE
            assert entry[str(token)]["rank"] == rank
        assert abs(entry[str(prompt[position])]["logprob"] - row[prompt[position]].item()) < TOLERANCE
    assert choice["logprobs"] is None  # prompt_logprobs alone does not turn on echo or output logprobs
    assert choice["text"] and not choice["text"].startswith(reference.tokenizer.decode(prompt))


def test_streamed_echo_equals_non_streamed(client):
    arguments = dict(model=MODEL, prompt=PROMPTS[0], echo=True, logprobs=1, max_tokens=3, temperature=0)
    whole = client.completions.create(**arguments).choices[0]
    chunks = list(client.completions.create(stream=True, **arguments))
    pieces = [choice for chunk in chunks for choice in chunk.choices]
    assert "".join(piece.text for piece in pieces) == whole.text
    tokens = [token for piece in pieces if piece.logprobs for token in piece.logprobs.tokens]
    values = [value for piece in pieces if piece.logprobs for value in piece.logprobs.token_logprobs]
    offsets = [offset for piece in pieces if piece.logprobs for offset in piece.logprobs.text_offset]
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
    assert values[0] is None and len(values) == len(whole.logprobs.token_logprobs)
    assert all(math.isclose(a, b) for a, b in zip(values[1:], whole.logprobs.token_logprobs[1:], strict=True))


def test_tokens_as_token_ids(server):
    body = {"prompt": [65, 66, 67], "echo": True, "logprobs": 1, "max_tokens": 0, "return_tokens_as_token_ids": True}
    logprobs = server.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["token_id:65", "token_id:66", "token_id:67"]
    assert all(key.startswith("token_id:") for top in logprobs["top_logprobs"][1:] for key in top)


def test_max_tokens_zero_echoes_n_choices_per_prompt(client):
    """vLLM's answer: with n, every prompt's n choices come back, each the echoed prompt."""
    choices = client.completions.create(model=MODEL, prompt=["hi", "yo"], echo=True, max_tokens=0, n=2).choices
    assert [(c.index, c.text, c.finish_reason) for c in choices] == [
        (0, "hi", "length"), (1, "hi", "length"), (2, "yo", "length"), (3, "yo", "length")
    ]  # fmt: skip


def test_max_tokens_zero_needs_echo_or_prompt_logprobs(server):
    response = server.post("/v1/completions", json={"prompt": [65, 66], "max_tokens": 0})
    assert response.status_code == 400 and "max_tokens" in response.json()["error"]["message"]


def test_blocks_return_to_the_pool(server):
    server.wait_until_drained()
