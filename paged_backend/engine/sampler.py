"""Logits -> next tokens: penalties, min_tokens, temperature, top-k / top-p / min-p, seeded draws, logprobs.

An all-greedy batch without penalties or logprobs takes a single argmax. Seeded sequences draw from their own
`torch.Generator`, so their tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

import torch

from paged_backend.engine.request import Sequence


class Sampler:
    """Turns one logits row per sequence into one token per sequence.

    >>> import torch
    >>> from paged_backend.engine.request import Request, SamplingParams, Sequence
    >>> seq = Sequence(Request("r", None, [1, 2], SamplingParams(temperature=0)), 0)
    >>> Sampler(eos_token_ids={0})(torch.tensor([[0.0, 3.0, 1.0]]), [seq])[0]
    [1]
    """

    def __init__(self, eos_token_ids: set[int], *, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.eos_token_ids = sorted(eos_token_ids)
        self.device = torch.device(device)
        # Unseeded requests share the engine's generator: runs repeat, the global RNG is left alone.
        self.generator = torch.Generator(self.device).manual_seed(seed)

    def generator_for(self, seq: Sequence) -> torch.Generator:
        """Seeded requests own their RNG, so their tokens never depend on what else is in the batch."""
        seed = seq.request.params.seed
        if seed is None:
            return self.generator
        if seq.generator is None:
            seq.generator = torch.Generator(self.device).manual_seed(hash((seed, seq.index)) & (2**63 - 1))
        return seq.generator

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[dict[int, float] | None]]:
        params = [seq.request.params for seq in seqs]
        wants_logprobs = [p.logprobs is not None for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(wants_logprobs) else None
        plain = all(p.greedy and not p.uses_penalties for p in params)
        if plain and not any(self._blocked_ids(seq) for seq in seqs):
            tokens = logits.argmax(dim=-1).tolist()
        else:
            tokens = self._sample(logits.clone(), seqs)
        logprobs = [
            self._logprobs(raw_logprobs[i], token, p.logprobs) if want else None
            for i, (token, p, want) in enumerate(zip(tokens, params, wants_logprobs, strict=True))
        ]
        return tokens, logprobs

    def _blocked_ids(self, seq: Sequence) -> list[int]:
        """Tokens that may not end the sequence yet (min_tokens)."""
        params = seq.request.params
        if seq.num_output_tokens >= params.min_tokens:
            return []
        return [*([] if params.ignore_eos else self.eos_token_ids), *params.stop_token_ids]

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        for i, seq in enumerate(seqs):
            params = seq.request.params
            if params.uses_penalties:
                self._apply_penalties(logits[i], seq)
            blocked = self._blocked_ids(seq)
            if blocked:
                logits[i, blocked] = float("-inf")
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, seq in enumerate(seqs) if not seq.request.params.greedy]
        if sampled:
            probs = self._probabilities(logits[sampled], [seqs[i].request.params for i in sampled])
            for row, i in enumerate(sampled):
                draw = torch.multinomial(probs[row], 1, generator=self.generator_for(seqs[i]))
                tokens[i] = draw[0]
        return tokens.tolist()

    @staticmethod
    def _apply_penalties(row: torch.Tensor, seq: Sequence) -> None:
        params = seq.request.params
        if params.repetition_penalty != 1:
            seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=row.device)
            values = row[seen]
            row[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
        if params.presence_penalty or params.frequency_penalty:
            output = torch.tensor(seq.output_token_ids, dtype=torch.long, device=row.device)
            counts = torch.bincount(output, minlength=row.shape[0])[: row.shape[0]].to(row.dtype)
            row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)

    @staticmethod
    def _probabilities(logits: torch.Tensor, params: list) -> torch.Tensor:
        """Temperature, then top-k, top-p and min-p masks, applied row-wise in one sort."""
        device, vocab = logits.device, logits.shape[-1]
        temperature = torch.tensor([p.temperature for p in params], device=device)
        # Extreme penalties can overflow to +inf; keep every row finite so softmax never yields NaN.
        logits = (logits / temperature[:, None]).clamp(max=torch.finfo(logits.dtype).max / 2)
        if all(p.top_k <= 0 and p.top_p == 1 and p.min_p == 0 for p in params):
            return torch.softmax(logits, dim=-1)
        ordered, order = logits.sort(dim=-1, descending=True)
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
        rank = torch.arange(vocab, device=device)[None, :]
        drop = rank >= top_k[:, None]
        ordered = ordered.masked_fill(drop, float("-inf"))
        probs = torch.softmax(ordered, dim=-1)
        top_p = torch.tensor([p.top_p for p in params], device=device)
        drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]  # keep the smallest set reaching top_p
        min_p = torch.tensor([p.min_p for p in params], device=device)
        drop |= probs < min_p[:, None] * probs[:, :1]
        drop[:, 0] = False  # the most likely token always survives
        ordered = ordered.masked_fill(drop, float("-inf"))
        return torch.softmax(torch.empty_like(ordered).scatter_(1, order, ordered), dim=-1)

    @staticmethod
    def _logprobs(row: torch.Tensor, token: int, top: int) -> dict[int, float]:
        result = {token: float(row[token])}
        if top:
            values, ids = row.topk(top)
            result.update(zip(ids.tolist(), values.tolist(), strict=True))
        return result
