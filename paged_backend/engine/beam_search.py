"""Beam search inside the engine (vLLM's `use_beam_search` and `LLM.beam_search`): a request's beams are sequences
that share their KV blocks, as in the PagedAttention paper. A beam chosen twice forks (refcounts; a shared last block
is copied on write), and a beam left out is freed.

Each step every live beam of a request proposes its 2 x width likeliest next tokens, by the model's log-probabilities
(vLLM's beam search reads the same). Candidates that end the beam (EOS unless ignored, a stop token) become finished
beams. The `width` best of the others by cumulative logprob go on. The choice waits until every live beam has
proposed: a beam that the scheduler left out of this step, or preempted, catches up first. So the result does not
depend on batching. At the end the `width` best finished beams by vLLM's score are the outputs:
cumulative logprob / tokens ** length_penalty, prompt included, a final end token not counted.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from paged_backend.engine.request import CompletionOutput, Logprob, Request, RequestOutput, Sequence, SequenceStatus
from paged_backend.engine.sampling_params import SamplingParams


class BeamSearch:
    """The engine's beam step: candidates from a step's logits, then each request's choice once all its beams
    proposed. `engine` gives the block manager, scheduler, output processor and counters it acts through."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def propose(self, logits: torch.Tensor, seqs: list[Sequence], advanced: dict[str, Request]) -> None:
        """Store each beam's candidates (one logits row each), then let every request whose beams all proposed
        choose its next beams."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        tops = [max(2 * seq.request.params.n, seq.request.params.logprobs or 0) for seq in seqs]
        values, ids = logprobs.topk(min(max(tops), logprobs.shape[-1]), dim=-1)  # a width past half the vocabulary
        for seq, top, row_ids, row_values in zip(seqs, tops, ids.tolist(), values.tolist(), strict=True):
            seq.beam_candidates = row_ids[:top], row_values[:top]
        for request in {id(seq.request): seq.request for seq in seqs}.values():
            if all(beam.beam_candidates is not None for beam in request.seqs):
                self._choose(request)
                if not request.seqs:  # the search reports once, at its end
                    self._write_texts(request)
                    advanced[request.request_id] = request

    def _choose(self, request: Request) -> None:
        params, rules = request.params, request.stop_rules
        width = params.n
        ending = set(rules.eos_token_ids) | set(rules.stop_token_ids)
        going: list[tuple[float, Sequence, int, float]] = []
        for beam in request.seqs:
            ids, values = beam.beam_candidates
            for token, value in zip(ids[: 2 * width], values[: 2 * width], strict=True):
                if token in ending:
                    self._finish(request, beam, token, value, "stop", token if token in rules.stop_token_ids else None)
                else:
                    going.append((beam.cumulative_logprob + value, beam, token, value))
        going.sort(key=lambda candidate: candidate[0], reverse=True)  # stable: ties keep beam, then rank order
        chosen: dict[int, list[tuple[int, float]]] = defaultdict(list)
        for _, beam, token, value in going[:width]:
            chosen[id(beam)].append((token, value))
        next_beams: list[tuple[Sequence, int, float, tuple]] = []
        for beam in request.seqs:
            picks = chosen.get(id(beam), [])
            for token, value in picks[1:]:  # forked before the beam takes its own token
                next_beams.append((self._branch(beam), token, value, beam.beam_candidates))
            if picks:
                next_beams.append((beam, *picks[0], beam.beam_candidates))
            else:
                self._drop(beam)
        request.seqs = [beam for beam, *_ in next_beams]
        for beam, token, value, candidates in next_beams:
            self._take(beam, token, value, candidates)
            self.engine.scheduler.wake(beam)  # one whose blocks were freed while it waited queues again
        for beam in list(request.seqs):
            if rules.out_of_budget(beam.num_output_tokens, beam.num_tokens):
                self._finish_live(request, beam)

    def _branch(self, beam: Sequence) -> Sequence:
        """A new beam continuing `beam`: sharing its blocks when it holds them, else to be computed again."""
        request = beam.request
        child = beam.branch(request.num_beams)
        request.num_beams += 1
        engine = self.engine
        if beam.status is SequenceStatus.RUNNING and engine.block_manager.has(beam.seq_id):
            engine.block_manager.fork(beam.seq_id, child.seq_id)
            engine.scheduler.add_running(child)
        else:  # preempted (waiting or swapped): the child recomputes, its prefix from the cache where it is there
            child.num_computed_tokens = 0
            engine.scheduler.add(child)
        return child

    def _take(self, beam: Sequence, token: int, value: float, candidates: tuple[list[int], list[float]]) -> None:
        beam.beam_candidates = None
        beam.token_ids.append(token)
        beam.cumulative_logprob += value
        self.engine.counters.generation_tokens += 1
        if beam.logprobs is not None:
            beam.logprobs.append(self._entry(beam.request, token, value, *candidates))

    def _entry(self, request: Request, token: int, value: float, ids: list[int], values: list[float]) -> dict:
        """vLLM's logprobs entry: the chosen token (its rank: tokens at least as likely) and the top k."""
        top = request.params.logprobs
        entry = {token: Logprob(value, sum(v >= value for v in values))}
        entry.update({t: Logprob(v, rank) for rank, (t, v) in enumerate(zip(ids[:top], values[:top], strict=True), 1)})
        if request.params.detokenize:
            self.engine.output_processor.token_texts.fill(entry)
        return entry

    def _finish(self, request: Request, beam: Sequence, token: int, value: float, reason: str, stop_reason) -> None:
        """A finished beam from `beam` plus `token` (an end token: not counted in the score's length)."""
        token_ids = [*beam.output_token_ids, token]
        logprobs = None
        if beam.logprobs is not None:
            logprobs = [*beam.logprobs, self._entry(request, token, value, *beam.beam_candidates)]
        completion = CompletionOutput(0, "", token_ids, logprobs, reason, stop_reason, beam.cumulative_logprob + value)
        self._keep(request, completion, ends=True)

    def _finish_live(self, request: Request, beam: Sequence) -> None:
        """A live beam out of tokens (max_tokens or the context): finished with "length", its blocks freed."""
        logprobs = None if beam.logprobs is None else list(beam.logprobs)
        completion = CompletionOutput(0, "", beam.output_token_ids, logprobs, "length", None, beam.cumulative_logprob)
        self._keep(request, completion, ends=False)
        request.seqs.remove(beam)
        self._drop(beam)

    @staticmethod
    def _keep(request: Request, completion: CompletionOutput, *, ends: bool) -> None:
        """Add a finished beam, keeping only the best n: a later one can displace them, never revive another."""
        length = len(request.prompt_token_ids) + len(completion.token_ids) - ends
        score = completion.cumulative_logprob / length**request.params.length_penalty
        request.finished_beams.append((score, completion))
        request.finished_beams.sort(key=lambda beam: beam[0], reverse=True)  # stable: the earlier first on a tie
        del request.finished_beams[request.params.n :]

    def _drop(self, beam: Sequence) -> None:
        beam.status = SequenceStatus.FINISHED
        self.engine.scheduler.remove(beam)

    def _write_texts(self, request: Request) -> None:
        """The returned beams' texts, decoded once at the end (an end token shown only with
        include_stop_str_in_output)."""
        params = request.params
        if not params.detokenize:
            return
        for _, completion in request.finished_beams:
            shown = completion.token_ids
            if completion.finish_reason == "stop" and not params.include_stop_str_in_output:
                shown = shown[:-1]
            completion.text = self.engine.tokenizer.decode(
                shown, skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
            )  # fmt: skip


# --- vLLM's offline API: LLM.beam_search(prompts, BeamSearchParams(...)) -> [BeamSearchOutput] -----------------------


@dataclass
class BeamSearchParams:
    """vLLM's `BeamSearchParams`. Beams are ranked by the model's log-probabilities: `temperature` is taken and has
    no effect there, as in vLLM."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def sampling_params(self) -> SamplingParams:
        """The engine request: n beams, each token's entry holding the 2 x width candidates, as vLLM's do."""
        return SamplingParams(
            n=self.beam_width, max_tokens=self.max_tokens, ignore_eos=self.ignore_eos, temperature=self.temperature,
            length_penalty=self.length_penalty, include_stop_str_in_output=self.include_stop_str_in_output,
            use_beam_search=True, logprobs=2 * self.beam_width,
        )  # fmt: skip


@dataclass
class BeamSearchSequence:
    """One finished beam as vLLM's `LLM.beam_search` gives it: `tokens` and `text` include the prompt."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best `beam_width` beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_search_output(output: RequestOutput, tokenizer) -> BeamSearchOutput:
    """An engine output of a beam-search request in vLLM's offline shape."""
    sequences = []
    for completion in output.outputs:
        tokens = [*output.prompt_token_ids, *completion.token_ids]
        sequences.append(BeamSearchSequence(tokens, completion.logprobs or [], completion.cumulative_logprob,
                                            tokenizer.decode(tokens), completion.finish_reason,
                                            completion.stop_reason))  # fmt: skip
    return BeamSearchOutput(sequences)
