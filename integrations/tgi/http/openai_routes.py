"""`/v1/chat/completions` and `/v1/completions` as TGI serves them: OpenAI shapes on top of `Infer`.

TGI semantics kept: temperature 0 means greedy and an absent temperature samples; `presence_penalty` p
becomes repetition_penalty p + 2; chat prompts come from the tokenizer's chat template without extra
special tokens; streams end with `data: [DONE]` and report errors as `{"error": {...}}` events.
`tools` and `response_format` set the request's grammar (`http/tools.py`), so replies always parse.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError as PydanticValidationError

from paged_backend import __version__
from paged_backend.engine.disconnect import cancel_on_disconnect
from paged_backend.tgi.http.errors import TemplateError, TgiError, ToolError, ValidationError
from paged_backend.tgi.http.grammar import ValidGrammar, response_format_grammar
from paged_backend.tgi.http.infer import Generation, Infer, StreamStep
from paged_backend.tgi.http.schemas import ChatMessage, ChatRequest, CompletionRequest, GenerateParameters, Grammar
from paged_backend.tgi.http.settings import RouterSettings
from paged_backend.tgi.http.sse import DONE, event, sse_response
from paged_backend.tgi.http.tools import ToolPlan, parse_reply, plan_tools, tool_prompt_text
from paged_backend.tgi.http.validation import check_unicode, validate_parameters

SYSTEM_FINGERPRINT = f"{__version__}-paged-backend"
FINISH_REASONS = {"eos_token": "stop", "length": "length", "stop_sequence": "stop_sequence"}


def _sampling(temperature: float | None) -> dict:
    if temperature == 0:
        return {"do_sample": False, "temperature": None}
    return {"do_sample": True, "temperature": temperature}


def _stop_list(stop: list[str] | str | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def chat_grammar(body: ChatRequest) -> tuple[ToolPlan | None, ValidGrammar | None]:
    """The tool plan and the grammar a chat request asks for (tools and response_format exclude each other)."""
    plan = plan_tools(body.tools, body.tool_choice)
    if plan is not None and body.response_format is not None:
        raise ToolError("give either `tools` or `response_format`, not both: each sets the output's grammar")
    return plan, plan.grammar if plan is not None else response_format_grammar(body.response_format)


def _check_range(name: str, value: float | None, low: float, high: float) -> None:
    if value is not None and not low <= value <= high:
        raise ValidationError(f"`{name}` must be >= {low} and <= {high}. Given: {value}")


def chat_parameters(
    body: ChatRequest, settings: RouterSettings, grammar: ValidGrammar | None = None
) -> GenerateParameters:
    """TGI's generate parameters for a chat request; fields TGI would pass on unchecked are range-checked here."""
    _check_range("presence_penalty", body.presence_penalty, -2.0, 2.0)  # becomes a repetition penalty of p + 2
    _check_range("top_logprobs", body.top_logprobs, 0, settings.max_top_n_tokens)
    _check_range("max_completion_tokens", body.max_completion_tokens, 1, settings.max_total_tokens - 1)
    repetition = body.presence_penalty + 2.0 if body.presence_penalty is not None else None
    return _parameters(
        **_sampling(body.temperature),
        max_new_tokens=body.max_tokens if body.max_tokens is not None else body.max_completion_tokens,
        top_p=body.top_p,
        seed=body.seed,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=repetition,
        stop=_stop_list(body.stop),
        top_n_tokens=body.top_logprobs if body.logprobs else None,
        details=True,
        grammar=None if grammar is None else Grammar(type=grammar.type, value=grammar.text),
    )


def _parameters(**fields) -> GenerateParameters:
    """GenerateParameters from OpenAI fields; a value its own types refuse (a negative seed) is a 422."""
    try:
        return GenerateParameters(**fields)
    except PydanticValidationError as error:
        problem = error.errors()[0]
        raise ValidationError(f"`{'.'.join(map(str, problem['loc']))}`: {problem['msg']}") from error


def _message_text(message: ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for part in message.content:
        if part.get("type") != "text":
            raise ValidationError(f"message content of type {part.get('type')!r} is not supported; send text")
        parts.append(part.get("text", ""))
    return "".join(parts)


def _turn(message: ChatMessage) -> dict:
    turn = {"role": message.role, "content": _message_text(message)}
    if message.tool_calls:
        turn["tool_calls"] = message.tool_calls
    if message.tool_call_id is not None:
        turn["tool_call_id"] = message.tool_call_id
    return turn


def chat_prompt(tokenizer, messages: list[ChatMessage], plan: ToolPlan | None = None, tool_prompt=None) -> str:
    """The chat template's prompt; tools go to templates that render them, else into the last message's text."""
    turns = [_turn(message) for message in messages]
    options = {}
    if plan is not None:
        if "tools" in (tokenizer.chat_template or ""):
            options["tools"] = [{"type": "function", "function": function} for function in plan.functions]
        elif turns:
            turns[-1]["content"] = f"{turns[-1]['content']}\n---\n{tool_prompt_text(plan, tool_prompt)}"
    try:
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True, **options)
    except Exception as error:  # jinja errors of the model's own template
        raise TemplateError(str(error)) from error


def _reply_message(generation: Generation, plan: ToolPlan | None) -> tuple[dict, str]:
    """The assistant message and OpenAI finish reason; with tools, the grammar's JSON becomes `tool_calls`."""
    finish_reason = FINISH_REASONS[generation.finish_reason]
    if plan is None:
        return {"role": "assistant", "content": generation.generated_text}, finish_reason
    reply = parse_reply(generation.generated_text)
    if reply.tool_calls is None:
        return {"role": "assistant", "content": reply.content}, finish_reason
    return {"role": "assistant", "content": None, "tool_calls": reply.tool_calls}, "tool_calls"


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

    def stream_openai(
        prompts: list[str], params: GenerateParameters, chunk, usage_chunk, add_special_tokens: bool
    ) -> Response:
        """One SSE stream over every prompt, in order; each step becomes `chunk(index, step)` (None: no frame).

        Every prompt is validated before the stream opens, so bad input gets its status code.
        """
        requests = [infer.validate(prompt, params, add_special_tokens=add_special_tokens) for prompt in prompts]

        async def frames() -> AsyncIterator[str]:
            try:
                for index, request in enumerate(requests):
                    with infer.permit():
                        async with contextlib.aclosing(infer.stream(request)) as steps:
                            async for step in steps:
                                frame = chunk(index, step)
                                if frame is not None:
                                    yield event(frame)
                                if step.generation is not None and usage_chunk is not None:
                                    yield event(usage_chunk(step.generation))
            except TgiError as error:
                yield event({"error": {"message": error.message, "http_status_code": error.status_code}})
                return
            yield DONE

        return sse_response(frames())

    async def generate_one(
        prompt: str, params: GenerateParameters, add_special_tokens: bool, http: Request
    ) -> Generation:
        with infer.permit():
            request = infer.validate(prompt, params, add_special_tokens=add_special_tokens)
            generation, _ = await cancel_on_disconnect(http, infer.generate(request))  # a hang-up aborts it
        return generation

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(body: ChatRequest, http: Request) -> Response:
        plan, grammar = chat_grammar(body)
        params = chat_parameters(body, settings, grammar)
        prompt = chat_prompt(infer.tokenizer, body.messages, plan, body.tool_prompt)
        want_logprobs = bool(body.logprobs)
        if body.stream:

            def chunk(index: int, step: StreamStep) -> dict | None:
                finished = step.generation
                if plan is not None:  # a call is only known once its JSON is complete: one delta at the end
                    if finished is None:
                        return None
                    message, finish_reason = _reply_message(finished, plan)
                    if message.get("tool_calls"):
                        message["tool_calls"] = [{"index": 0, **call} for call in message["tool_calls"]]
                    choice = {"index": index, "delta": message, "logprobs": None, "finish_reason": finish_reason}
                    return {**envelope("chat.completion.chunk"), "choices": [choice], "usage": None}
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
            return stream_openai([prompt], params, chunk, usage_chunk if include_usage else None, False)
        generation = await generate_one(prompt, params, add_special_tokens=False, http=http)
        message, finish_reason = _reply_message(generation, plan)
        choice = {
            "index": 0,
            "message": message,
            "logprobs": _logprobs_json(generation) if want_logprobs else None,
            "finish_reason": finish_reason,
        }
        return JSONResponse({**envelope("chat.completion"), "choices": [choice], "usage": _usage(generation)})

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(body: CompletionRequest, http: Request) -> Response:
        if body.suffix is not None:
            raise ValidationError("suffix not supported")
        prompts = [body.prompt] if isinstance(body.prompt, str) else list(body.prompt)
        if not prompts:
            raise ValidationError("`prompt` must hold at least one prompt")
        if len(prompts) > settings.max_client_batch_size:
            raise ValidationError(
                f"batch size exceeded: {len(prompts)} prompts, at most {settings.max_client_batch_size}"
            )
        params = _parameters(
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

            return stream_openai(prompts, params, chunk, None, True)
        generations = [await generate_one(prompt, params, add_special_tokens=True, http=http) for prompt in prompts]
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
        """The chat request's prompt; its sampling fields are checked as chat completions would check them."""
        plan, grammar = chat_grammar(body)
        validate_parameters(chat_parameters(body, settings, grammar), settings)
        _check_range("max_tokens", body.max_tokens, 1, settings.max_total_tokens - 1)
        prompt = chat_prompt(infer.tokenizer, body.messages, plan, body.tool_prompt)
        encoding = infer.tokenizer(check_unicode(prompt, "messages"), add_special_tokens=False,
                                   return_offsets_mapping=True)  # fmt: skip
        pieces = [
            {"id": token_id, "text": prompt[start:stop], "start": start, "stop": stop}
            for token_id, (start, stop) in zip(encoding.input_ids, encoding.offset_mapping, strict=True)
        ]
        return JSONResponse({"tokenize_response": pieces, "templated_text": prompt})

    return chat_completions
