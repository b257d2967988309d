"""The /v1/chat/completions request body: messages and the chat-only fields, on the shared sampling fields."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from paged_backend.server.schemas import _SamplingRequest, _Strict


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    add_generation_prompt: bool = True

    def requested_logprobs(self) -> int | None:
        """Engine logprobs count: top alternatives per token, or None when logprobs are off."""
        return (self.top_logprobs or 0) if self.logprobs else None
