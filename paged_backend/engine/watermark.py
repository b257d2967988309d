"""TGI's green-list watermark (Kirchenbauer et al. 2023): bias a pseudo-random half of the vocabulary, then detect it.

Each step, the previous token seeds a permutation of the vocabulary; its first `gamma` fraction is the "green list",
whose logits get `+delta`. Text written that way holds far more green tokens than chance, which `watermark_z_score`
measures without the model. Seeding follows TGI (hash key times the previous token), so text watermarked by either
server is detected by the same helper.
"""

from __future__ import annotations

import math

import torch

GAMMA = 0.5
DELTA = 2.0
HASH_KEY = 15485863  # the millionth prime, TGI's key


def green_list(previous_token: int, vocab_size: int, gamma: float = GAMMA) -> torch.Tensor:
    """Token ids on the green list after `previous_token` (CPU, deterministic)."""
    generator = torch.Generator().manual_seed(HASH_KEY * previous_token)
    return torch.randperm(vocab_size, generator=generator)[: int(vocab_size * gamma)]


def apply_watermark(logits: torch.Tensor, previous_token: int, gamma: float = GAMMA, delta: float = DELTA) -> None:
    """Add `delta` to the green tokens of one logits row, in place."""
    logits[green_list(previous_token, logits.shape[-1], gamma).to(logits.device)] += delta


def watermark_z_score(token_ids: list[int], vocab_size: int, gamma: float = GAMMA) -> float:
    """How many standard deviations the green-token count of `token_ids` sits above chance.

    Every token after the first is scored against the green list its predecessor seeds. Plain text scores near 0;
    watermarked text of a few hundred tokens scores well above 4.

    >>> round(watermark_z_score([1, 2], 256), 3) in (-1.0, 1.0)
    True
    """
    if len(token_ids) < 2:
        return 0.0
    scored = len(token_ids) - 1
    green = sum(
        1 for previous, token in zip(token_ids, token_ids[1:], strict=False)
        if bool((green_list(previous, vocab_size, gamma) == token).any())
    )
    expected = gamma * scored
    return (green - expected) / math.sqrt(scored * gamma * (1 - gamma))
