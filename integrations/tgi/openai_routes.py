"""`/v1/chat/completions` and `/v1/completions` as TGI serves them: OpenAI shapes on top of `Infer`.

TGI semantics kept: temperature 0 means greedy and an absent temperature samples; `presence_penalty` p
becomes repetition_penalty p + 2; chat prompts come from the tokenizer's chat template without extra
special tokens; streams end with `data: [DONE]` and report errors as `{"error": {...}}` events.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from paged_backend import __version__
from paged_backend.tgi.errors import TemplateError, TgiError, ValidationError
from paged_backend.tgi.infer import Generation, Infer, StreamStep
from paged_backend.tgi.schemas import ChatMessage, ChatRequest, CompletionRequest, GenerateParameters
from paged_backend.tgi.settings import RouterSettings
from paged_backend.tgi.sse import DONE, event, sse_response

SYSTEM_FINGERPRINT = f"{__version__}-paged-backend"
FINISH_REASONS = {"eos_token": "stop", "length": "length", "stop_sequence": "stop_sequence"}


def _sampling(temperature: float | None) -> dict:
    if temperature == 0:
        return {"do_sample": False, "temperature": None}
    return {"do_sample": True, "temperature": temperature}


def _stop_list(stop: list[str] | str | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def chat_parameters(body: ChatRequest) -> GenerateParameters:
    if body.tools:
        raise ValidationError("tools are not supported by paged-backend")
    if body.response_format is not None:
        raise ValidationError("grammar is not supported")
    repetition = body.presence_penalty + 2.0 if body.presence_penalty is not None else None
    return GenerateParameters(
        **_sampling(body.temperature),
        max_new_tokens=body.max_tokens if body.max_tokens is not None else body.max_completion_tokens,
        top_p=body.top_p,
        seed=body.seed,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=repetition,
        stop=_stop_list(body.stop),
        top_n_tokens=body.top_logprobs if body.logprobs else None,
        details=True,
    )


def _message_text(message: ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for part in message.content:
        if part.get("type") != "text":
            raise ValidationError(f"message content of type {part.get('type')!r} is not supported; send text")
        parts.append(part.get("text", ""))
    return "".join(parts)


def chat_prompt(tokenizer, messages: list[ChatMessage]) -> str:
    turns = [{"role": message.role, "content": _message_text(message)} for message in messages]
    try:
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    except Exception as error:  # jinja errors of the model's own template
        raise TemplateError(str(error)) from error


def _logprobs_json(generation: Generation) -> dict:
    content = []
    for index, token in enumerate(generation.tokens):
        tops = generation.top_tokens[index] if index < len(generation.top_tokens) else []
        content.append(
            {
                "token": token.text,
                "logprob": token.logprob,
                "top_logprobs": [{"token": top.text, "logprob": top.logprob} for top in tops],
            }
        )
    return {"content": content}


def _usage(generation: Generation) -> dict:
    return {
        "prompt_tokens": generation.input_length,
        "completion_tokens": generation.generated_tokens,
        "total_tokens": generation.input_length + generation.generated_tokens,
    }


def register(app: FastAPI, infer: Infer, settings: RouterSettings, guarded: list):
    """Add the OpenAI-shaped routes; returns the chat handler (SageMaker's /invocations reuses it)."""

    def envelope(obj: str) -> dict:
        return {
            "object": obj,
            "id": "",
            "created": int(time.time()),
            "model": settings.model_id,
            "system_fingerprint": SYSTEM_FINGERPRINT,
        }

    async def stream_openai(
        prompts: list[str], params: GenerateParameters, chunk, usage_chunk, add_special_tokens: bool
    ) -> AsyncIterator[str]:
        """One SSE stream over every prompt, in order; each step becomes `chunk(index, step)`."""
        try:
            for index, prompt in enumerate(prompts):
                with infer.permit():
                    request = infer.validate(prompt, params, add_special_tokens=add_special_tokens)
                    async with contextlib.aclosing(infer.stream(request)) as steps:
                        async for step in steps:
                            yield event(chunk(index, step))
                            if step.generation is not None and usage_chunk is not None:
                                yield event(usage_chunk(step.generation))
        except TgiError as error:
            yield event({"error": {"message": error.message, "http_status_code": error.status_code}})
            return
        yield DONE

    async def generate_one(prompt: str, params: GenerateParameters, add_special_tokens: bool) -> Generation:
        with infer.permit():
            request = infer.validate(prompt, params, add_special_tokens=add_special_tokens)
            generation, _ = await infer.generate(request)
        return generation

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(body: ChatRequest) -> Response:
        params = chat_parameters(body)
        prompt = chat_prompt(infer.tokenizer, body.messages)
        want_logprobs = bool(body.logprobs)
        if body.stream:

            def chunk(index: int, step: StreamStep) -> dict:
                finished = step.generation
                content = "" if step.token.special else step.token.text
                logprobs = None
                if want_logprobs:
                    tops = [{"token": t.text, "logprob": t.logprob} for t in step.top_tokens]
                    token = {"token": step.token.text, "logprob": step.token.logprob, "top_logprobs": tops}
                    logprobs = {"content": [token]}
                choice = {
                    "index": index,
                    "delta": {"role": "assistant", "content": content},
                    "logprobs": logprobs,
                    "finish_reason": None if finished is None else FINISH_REASONS[finished.finish_reason],
                }
                return {**envelope("chat.completion.chunk"), "choices": [choice], "usage": None}

            def usage_chunk(generation: Generation) -> dict:
                return {**envelope("chat.completion.chunk"), "choices": [], "usage": _usage(generation)}

            include_usage = body.stream_options is not None and body.stream_options.include_usage
            frames = stream_openai([prompt], params, chunk, usage_chunk if include_usage else None, False)
            return sse_response(frames)
        generation = await generate_one(prompt, params, add_special_tokens=False)
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": generation.generated_text},
            "logprobs": _logprobs_json(generation) if want_logprobs else None,
            "finish_reason": FINISH_REASONS[generation.finish_reason],
        }
        return JSONResponse({**envelope("chat.completion"), "choices": [choice], "usage": _usage(generation)})

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(body: CompletionRequest) -> Response:
        if body.suffix is not None:
            raise ValidationError("suffix not supported")
        prompts = [body.prompt] if isinstance(body.prompt, str) else list(body.prompt)
        if len(prompts) > settings.max_client_batch_size:
            raise ValidationError(
                f"batch size exceeded: {len(prompts)} prompts, at most {settings.max_client_batch_size}"
            )
        params = GenerateParameters(
            **_sampling(body.temperature),
            max_new_tokens=body.max_tokens,
            top_p=body.top_p,
            seed=body.seed,
            repetition_penalty=body.repetition_penalty,
            frequency_penalty=body.frequency_penalty,
            stop=_stop_list(body.stop),
            details=True,
        )
        if body.stream:

            def chunk(index: int, step: StreamStep) -> dict:
                finished = step.generation
                choice = {
                    "index": index,
                    "text": step.token.text,
                    "logprobs": None,
                    "finish_reason": None if finished is None else FINISH_REASONS[finished.finish_reason],
                }
                return {**envelope("text_completion"), "choices": [choice]}

            return sse_response(stream_openai(prompts, params, chunk, None, True))
        generations = [await generate_one(prompt, params, add_special_tokens=True) for prompt in prompts]
        choices = [
            {
                "index": index,
                "text": generation.generated_text,
                "logprobs": None,
                "finish_reason": FINISH_REASONS[generation.finish_reason],
            }
            for index, generation in enumerate(generations)
        ]
        usage = {
            "prompt_tokens": sum(g.input_length for g in generations),
            "completion_tokens": sum(g.generated_tokens for g in generations),
        }
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return JSONResponse({**envelope("text_completion"), "choices": choices, "usage": usage})

    @app.post("/chat_tokenize")
    async def chat_tokenize(body: ChatRequest) -> JSONResponse:
        prompt = chat_prompt(infer.tokenizer, body.messages)
        encoding = infer.tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)
        pieces = [
            {"id": token_id, "text": prompt[start:stop], "start": start, "stop": stop}
            for token_id, (start, stop) in zip(encoding.input_ids, encoding.offset_mapping, strict=True)
        ]
        return JSONResponse({"tokenize_response": pieces, "templated_text": prompt})

    return chat_completions
