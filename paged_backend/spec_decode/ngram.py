"""Prompt lookup: find the sequence's latest suffix n-gram earlier in its own tokens, propose what followed it."""

from __future__ import annotations


def propose_ngram(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the longest matching suffix.

    >>> propose_ngram([1, 2, 3, 4, 1, 2], k=2, min_n=1, max_n=3)
    [3, 4]
    >>> propose_ngram([5, 6, 7], k=2, min_n=1, max_n=3)
    []
    """
    total = len(token_ids)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = token_ids[total - n :]
        first = suffix[0]
        for start in range(total - n - 1, -1, -1):  # latest match first: it is the freshest context
            if token_ids[start] == first and token_ids[start : start + n] == suffix:
                return token_ids[start + n : start + n + k]
    return []
