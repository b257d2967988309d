"""JSON shapes of TGI's generate responses (router `GenerateResponse`, `Details`, `StreamResponse`)."""

from __future__ import annotations

from paged_backend.tgi.http.infer import Generation, StreamStep


def details_json(generation: Generation, best_of: list[Generation] | None = None) -> dict:
    details = {
        "finish_reason": generation.finish_reason,
        "generated_tokens": generation.generated_tokens,
        "seed": generation.seed,
        "prefill": [token.to_prefill_json() for token in generation.prefill],
        "tokens": [token.to_json() for token in generation.tokens],
    }
    if generation.top_tokens:
        details["top_tokens"] = [[token.to_json() for token in tops] for tops in generation.top_tokens]
    if best_of:
        details["best_of_sequences"] = [_best_of_sequence(candidate) for candidate in best_of]
    return details


def _best_of_sequence(generation: Generation) -> dict:
    return {"generated_text": generation.generated_text, **details_json(generation)}


def generate_json(generation: Generation, prompt_prefix: str, with_details: bool, best_of: list[Generation]) -> dict:
    body = {"generated_text": prompt_prefix + generation.generated_text}
    if with_details:
        body["details"] = details_json(generation, best_of)
    return body


def stream_json(step: StreamStep, prompt_prefix: str, with_details: bool) -> dict:
    body = {"index": step.index, "token": step.token.to_json()}
    if step.top_tokens:
        body["top_tokens"] = [token.to_json() for token in step.top_tokens]
    generation = step.generation
    body["generated_text"] = None if generation is None else prompt_prefix + generation.generated_text
    body["details"] = None
    if generation is not None and with_details:
        body["details"] = {
            "finish_reason": generation.finish_reason,
            "generated_tokens": generation.generated_tokens,
            "seed": generation.seed,
            "input_length": generation.input_length,
        }
    return body


def timing_headers(generation: Generation, compute_type: str, validation_time: float, total_time: float) -> dict:
    ms = 1000.0
    per_token = generation.inference_time / max(generation.generated_tokens, 1)
    return {
        "x-compute-type": compute_type,
        "x-compute-time": f"{total_time:.6f}",
        "x-compute-characters": str(len(generation.generated_text)),
        "x-total-time": str(int(total_time * ms)),
        "x-validation-time": str(int(validation_time * ms)),
        "x-queue-time": str(int(generation.queue_time * ms)),
        "x-inference-time": str(int(generation.inference_time * ms)),
        "x-time-per-token": str(int(per_token * ms)),
        "x-prompt-tokens": str(generation.input_length),
        "x-generated-tokens": str(generation.generated_tokens),
    }
