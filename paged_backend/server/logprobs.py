"""Engine logprobs (one {token_id: logprob} dict per token) in OpenAI's response shapes and vLLM's prompt_logprobs.

Tokens are shown as their decoded text, or as "token_id:N" when the request sets vLLM's
`return_tokens_as_token_ids` (text that does not decode on its own, like half a UTF-8 character, stays exact).
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from paged_backend.engine.request import Logprob


def _top(entry: dict[int, float], count: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: item[1], reverse=True)[:count]


def token_text(tokenizer: PreTrainedTokenizerBase, token_id: int, as_token_ids: bool = False) -> str:
    return f"token_id:{token_id}" if as_token_ids else tokenizer.decode([token_id])


def completion_logprobs(
    tokenizer: PreTrainedTokenizerBase,
    token_ids: Sequence[int],
    logprobs: Sequence[dict[int, float] | None],
    num_top: int,
    text_offset: int,
    *,
    as_token_ids: bool = False,
) -> dict:
    """The legacy completions shape: parallel lists of tokens, their logprobs, top alternatives, offsets.

    A token's `top_logprobs` holds the token itself first, then the `num_top` most likely (up to num_top + 1 items,
    as OpenAI's legacy API and vLLM give them: the engine's entry is in that order). An entry of None (the first
    prompt token under echo, which nothing predicts) gives null logprob and top.
    """
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, logprobs, strict=False):
        token = token_text(tokenizer, token_id, as_token_ids)
        tokens.append(token)
        token_logprobs.append(None if entry is None else entry.get(token_id))
        top_logprobs.append(
            None if entry is None
            else {token_text(tokenizer, alt, as_token_ids): value
                  for rank, (alt, value) in enumerate(entry.items()) if rank <= num_top}
        )  # fmt: skip
        offsets.append(text_offset)
        text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def joined_logprobs(first: dict, second: dict) -> dict:
    """Two legacy-shape logprob objects, one after the other (the echoed prompt, then the completion)."""
    return {key: first[key] + second[key] for key in first}


def vllm_prompt_logprobs(prompt_logprobs: Sequence[dict[int, Logprob] | None]) -> list[dict[str, dict] | None]:
    """vLLM's `prompt_logprobs` in a choice: per prompt token None (the first) or {"<token id>": {logprob, rank,
    decoded_token}} holding the prompt token and its alternatives, each with the rank and text the engine gave it
    (`engine.request.Logprob`)."""
    return [None if entry is None else {
        str(token): {"logprob": value, "rank": value.rank, "decoded_token": value.decoded_token}
        for token, value in entry.items()
    } for entry in prompt_logprobs]  # fmt: skip


def chat_logprobs(
    tokenizer: PreTrainedTokenizerBase,
    token_ids: list[int],
    logprobs: list[dict[int, float]],
    num_top: int,
    *,
    as_token_ids: bool = False,
) -> dict:
    """The chat shape: one object per token with its bytes and its top alternatives."""

    def described(token_id: int, logprob: float | None) -> dict:
        text = tokenizer.decode([token_id])
        token = f"token_id:{token_id}" if as_token_ids else text
        return {"token": token, "logprob": logprob, "bytes": list(text.encode())}

    content = []
    for token_id, entry in zip(token_ids, logprobs, strict=False):
        item = described(token_id, entry.get(token_id))
        item["top_logprobs"] = [described(alt, value) for alt, value in _top(entry, num_top)]
        content.append(item)
    return {"content": content}
