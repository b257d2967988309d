"""Verification of draft tokens against the target's distributions (Leviathan et al. 2023; Chen et al. 2023).

Both proposers here are deterministic (prompt lookup; the draft model's argmax), so the draft distribution q is
one-hot at the drafted token x: accept x with probability min(1, p(x)/q(x)) = p(x); on rejection draw from the
residual max(p - q, 0), which is p with x removed, renormalized. Every emitted token is then distributed exactly
as the target's p, and if all drafts pass one more token is drawn from the next row.
"""

from __future__ import annotations

import torch


def verify_greedy(target_logits: torch.Tensor, draft: list[int]) -> list[int]:
    """Accepted drafts (while they equal the target's argmax) plus the target's own next token."""
    best = target_logits.argmax(dim=-1).tolist()
    accepted = 0
    while accepted < len(draft) and draft[accepted] == best[accepted]:
        accepted += 1
    return draft[:accepted] + [best[accepted]]


def verify_sampled(probs: torch.Tensor, draft: list[int], generator: torch.Generator) -> list[int]:
    """Rejection sampling over rows `probs` [len(draft) + 1, vocab]; tokens emitted follow the target exactly."""
    uniforms = torch.rand(len(draft), generator=generator, device=probs.device).tolist()
    for i, token in enumerate(draft):
        if uniforms[i] < float(probs[i, token]):
            continue
        residual = probs[i].clone()
        residual[token] = 0
        return draft[:i] + [int(torch.multinomial(residual, 1, generator=generator))]
    return draft + [int(torch.multinomial(probs[len(draft)], 1, generator=generator))]
