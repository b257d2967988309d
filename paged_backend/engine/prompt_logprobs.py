"""Prompt logprobs (vLLM's `prompt_logprobs`, echo, TGI's `decoder_input_details`): which packed rows to keep, and
what to record from their logits.

The logit at prompt position p scores prompt token p + 1. A request asking for them reads no prefix cache until
they are all recorded (a cached prefix has no logits), and a recompute after preemption skips positions already
recorded, so every value comes from a forward over exactly the prompt before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_backend.engine.output_processor import TokenTexts
from paged_backend.engine.request import Logprob, Request
from paged_backend.engine.scheduler import ScheduledSequence

ROWS_PER_CHUNK = 256  # bounds the log_softmax temporaries for long prompts


@dataclass
class PromptSegment:
    request: Request
    first: int  # first prompt position whose logits are kept
    end: int  # one past the last


def prompt_logprob_rows(scheduled: list[ScheduledSequence]) -> tuple[list[int], list[PromptSegment]]:
    """Packed row indices whose logits prompt logprobs need this step, and which request positions they are."""
    rows: list[int] = []
    segments: list[PromptSegment] = []
    row_start = 0
    for item in scheduled:
        request = item.seq.request
        recorded = request.prompt_logprobs
        if recorded is not None and item.seq.index == 0:
            first = max(item.start, len(recorded) - 1)
            end = min(item.start + item.num_tokens, len(request.prompt_token_ids) - 1)
            if first < end:
                rows += range(row_start + first - item.start, row_start + end - item.start)
                segments.append(PromptSegment(request, first, end))
        row_start += item.num_tokens
    return rows, segments


def record_prompt_logprobs(logits: torch.Tensor, segments: list[PromptSegment], texts: TokenTexts) -> None:
    """Append `{next prompt token: logprob, top-k...}` per kept row to each segment's request, in order, each a
    `Logprob` with its rank and text."""
    offset = 0
    for segment in segments:
        request, count = segment.request, segment.end - segment.first
        top = request.params.prompt_logprobs
        targets = request.prompt_token_ids[segment.first + 1 : segment.end + 1]
        for chunk in range(0, count, ROWS_PER_CHUNK):
            rows = torch.log_softmax(logits[offset + chunk : offset + min(count, chunk + ROWS_PER_CHUNK)], dim=-1)
            ids = torch.tensor(targets[chunk : chunk + rows.shape[0]], dtype=torch.long, device=rows.device)
            chosen = rows.gather(1, ids[:, None])
            ranks = (rows >= chosen).sum(dim=-1).tolist()  # vLLM's rank: the tokens at least as likely
            chosen = chosen[:, 0].tolist()
            if top:
                values, alternatives = rows.topk(top, dim=-1)
                values, alternatives = values.tolist(), alternatives.tolist()
            for i, token in enumerate(ids.tolist()):
                entry = {token: Logprob(chosen[i], ranks[i])}
                if top:  # the prompt token stays first
                    entry.update({alternative: Logprob(value, rank) for rank, (alternative, value)
                                  in enumerate(zip(alternatives[i], values[i], strict=True), 1)})  # fmt: skip
                request.prompt_logprobs.append(texts.fill(entry) if request.params.detokenize else entry)
        offset += count
