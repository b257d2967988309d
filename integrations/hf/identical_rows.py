"""Rows of a batch whose prompt is the same: generate repeats each prompt k times before the prefill."""

from __future__ import annotations

import torch


def identical_rows(
    key: torch.Tensor, value: torch.Tensor, columns: torch.Tensor, block_tables: list[tuple[int, ...]]
) -> dict[int, int]:
    """Map each row that repeats an earlier row to that earlier row (its leader).

    Rows match when they hold the same blocks (the same past) and the first layer's new K and V (which encode
    token ids and positions) and stored-column masks are bitwise equal; later layers are re-checked as they
    run, so a match is never taken on trust.

    >>> k = torch.tensor([[1.0], [2.0], [1.0]])
    >>> identical_rows(k, k, torch.ones(3, 1, dtype=torch.bool), [(), (), ()])
    {2: 0}
    """
    leaders: list[int] = []
    followers: dict[int, int] = {}
    for row in range(key.shape[0]):
        for leader in leaders:
            if (
                block_tables[row] == block_tables[leader]
                and torch.equal(columns[row], columns[leader])
                and torch.equal(key[row], key[leader])
                and torch.equal(value[row], value[leader])
            ):
                followers[row] = leader
                break
        else:
            leaders.append(row)
    return followers
