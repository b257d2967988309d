"""Prompt lookup: find the sequence's latest suffix n-gram earlier in its own tokens, propose what followed it."""

from __future__ import annotations

from itertools import chain


def propose_ngram(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` tokens that followed an earlier occurrence of the longest matching suffix: the latest occurrence
    with `k` tokens after it (fresh context, a full proposal), else the earliest one (the longest it has).

    >>> propose_ngram([1, 2, 3, 4, 1, 2], k=2, min_n=1, max_n=3)
    [3, 4]
    >>> propose_ngram([7, 7, 7, 7, 7], k=3, min_n=1, max_n=1)
    [7, 7, 7]
    >>> propose_ngram([5, 6, 7], k=2, min_n=1, max_n=3)
    []
    """
    total = len(token_ids)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = token_ids[total - n :]
        last = total - n - 1  # the latest start that is not the suffix itself
        full = range(min(last, total - n - k), -1, -1)  # starts with k tokens after the match, latest first
        partial = range(max(0, total - n - k + 1), last + 1)  # the rest, earliest (longest continuation) first
        first = suffix[0]
        for start in chain(full, partial):
            if token_ids[start] == first and token_ids[start : start + n] == suffix:
                return token_ids[start + n : start + n + k]
    return []
