"""Engine logprobs (one {token_id: logprob} dict per output token) in OpenAI's two response shapes."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


def _top(entry: dict[int, float], count: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: item[1], reverse=True)[:count]


def completion_logprobs(
    tokenizer: PreTrainedTokenizerBase,
    token_ids: list[int],
    logprobs: list[dict[int, float]],
    num_top: int,
    text_offset: int,
) -> dict:
    """The legacy completions shape: parallel lists of tokens, their logprobs, top alternatives, offsets."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, logprobs, strict=False):
        token = tokenizer.decode([token_id])
        tokens.append(token)
        token_logprobs.append(entry.get(token_id))
        top_logprobs.append({tokenizer.decode([alt]): value for alt, value in _top(entry, num_top)})
        offsets.append(text_offset)
        text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def chat_logprobs(
    tokenizer: PreTrainedTokenizerBase, token_ids: list[int], logprobs: list[dict[int, float]], num_top: int
) -> dict:
    """The chat shape: one object per token with its bytes and its top alternatives."""

    def described(token_id: int, logprob: float | None) -> dict:
        token = tokenizer.decode([token_id])
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    content = []
    for token_id, entry in zip(token_ids, logprobs, strict=False):
        item = described(token_id, entry.get(token_id))
        item["top_logprobs"] = [described(alt, value) for alt, value in _top(entry, num_top)]
        content.append(item)
    return {"content": content}
