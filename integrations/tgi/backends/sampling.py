"""TGI chooser / stopping parameters -> the engine's `SamplingParams` (one mapping for every path)."""

from __future__ import annotations

from paged_backend.engine.sampling_params import SamplingParams
from paged_backend.tgi.backends.base import FinishReason
from paged_backend.tgi.http.validation import ChooserParameters, StoppingParameters


def sampling_params(
    parameters: ChooserParameters,
    stopping: StoppingParameters,
    top_n_tokens: int = 0,
    *,
    prefill_logprobs: bool = False,
) -> SamplingParams:
    """Greedy unless TGI would sample; `logprobs` always on, since every TGI token carries its logprob.

    Warpers (typical_p with the others) act only when sampling; the watermark and the grammar also bend greedy
    choices, as in TGI's chooser. `prefill_logprobs` (decoder_input_details) asks for the prompt's own logprobs.
    """
    grammar = parameters.grammar
    return SamplingParams(
        max_tokens=stopping.max_new_tokens,
        temperature=parameters.temperature if parameters.do_sample else 0.0,
        top_k=parameters.top_k,
        top_p=parameters.top_p,
        typical_p=parameters.typical_p if parameters.do_sample else 1.0,
        repetition_penalty=parameters.repetition_penalty,
        frequency_penalty=parameters.frequency_penalty,
        seed=parameters.seed if parameters.do_sample else None,
        stop=list(stopping.stop_sequences),
        ignore_eos=stopping.ignore_eos_token,
        logprobs=top_n_tokens,
        prompt_logprobs=0 if prefill_logprobs else None,
        watermark=parameters.watermark,
        structured_outputs=None if grammar is None else grammar.structured_outputs(),
    )


def finish_reason(engine_reason: str, stop_reason: int | str | None) -> FinishReason:
    """Engine finish reasons in TGI's words: a stop string is `stop_sequence`, any other stop is EOS."""
    if engine_reason == "length":
        return "length"
    return "stop_sequence" if isinstance(stop_reason, str) else "eos_token"
