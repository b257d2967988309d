"""Output processing: from sampled tokens to sequence state and `RequestOutput`s (vLLM V1's OutputProcessor).

Each token is appended, walked through the request's grammar, detokenized (`detokenizer`), and checked against the
request's stop rules (`stopping`); a finished sequence leaves the scheduler and frees its blocks at once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from paged_backend.engine.request import Logprob, Request, RequestOutput, Sequence, SequenceStatus
from paged_backend.engine.scheduler import Scheduler

log = logging.getLogger(__name__)


class OutputProcessor:
    def __init__(self, tokenizer, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer

    @property
    def tokenizer(self):
        return self.token_texts.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer) -> None:  # a new tokenizer (Engine.set_tokenizer) starts a new text cache
        self.token_texts = TokenTexts(tokenizer)

    def append_token(self, seq: Sequence, token: int, logprob: dict[int, Logprob] | None) -> None:
        seq.token_ids.append(token)
        texts = seq.request.params.detokenize  # False: token ids only (nothing matches text: no stop strings)
        if logprob is not None:
            seq.logprobs.append(self.token_texts.fill(logprob) if texts else logprob)
        if seq.grammar is not None and not seq.grammar.accept(token) and (error := seq.grammar.error()):
            # the grammar engine gave up (a limit of its own): the sequence stops here, said in the log, not silently
            log.warning("request %s: its structured-output constraint failed at output token %d, which ends it: %s",
                        seq.request.request_id, seq.num_output_tokens, error.splitlines()[0])  # fmt: skip
        new_text = self.detokenize(seq) if texts else ""
        stop = seq.request.stop_rules.check(
            token, seq.text, new_text, seq.num_output_tokens, seq.num_tokens, seq.grammar
        )
        if stop is not None:
            if stop.text_end is not None:
                seq.text = seq.text[: stop.text_end]
            self.finish(seq, stop.reason, stop.stop_reason)

    def detokenize(self, seq: Sequence) -> str:
        """Append the text of the newest token(s) to `seq.text` and return it ('' while a character is incomplete)."""
        new_text = seq.detokenizer.next_text(self.tokenizer, seq.token_ids)
        seq.text += new_text
        return new_text

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        seq.status, seq.finish_reason, seq.stop_reason = SequenceStatus.FINISHED, reason, stop_reason
        self.scheduler.remove(seq)

    @staticmethod
    def request_outputs(advanced: Iterable[Request], now: float) -> list[RequestOutput]:
        """The cumulative output of every request that got a token (or finished) this step; marks finished ones."""
        outputs = []
        for request in advanced:
            request.metrics.record_token(now)
            if all(seq.is_finished for seq in request.seqs):
                request.finished = True
                request.metrics.finished_time = now
            outputs.append(request.output())
        return outputs


class TokenTexts:
    """vLLM's `decoded_token`: each token's text alone, decoded once per tokenizer and kept (a vocabulary's worth
    at most), since logprobs ask for the same few thousand tokens step after step."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.texts = tokenizer, {}

    def fill(self, entry: dict[int, Logprob]) -> dict[int, Logprob]:
        """`entry`'s Logprobs with their `decoded_token` set, in place."""
        missing = [token for token in entry if token not in self.texts]
        if missing:
            self.texts.update(zip(missing, self.tokenizer.batch_decode([[token] for token in missing]), strict=True))
        for token, logprob in entry.items():
            logprob.decoded_token = self.texts[token]
        return entry


def top_logprobs(entry: dict[int, float], count: int) -> list[tuple[int, float]]:
    """The `count` most likely (token id, logprob) pairs of one token's logprobs, most likely first."""
    if not count:
        return []
    return sorted(entry.items(), key=lambda item: item[1], reverse=True)[:count]
