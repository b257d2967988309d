"""Per-choice readers that turn a model's growing text into OpenAI tool-call deltas, or whole calls at the end.

`ParsedToolCallStream` reparses the whole text on each delta and sends only what grew since the last one
(outputs are short, so the rescan costs nothing next to a decode step). `NamedToolCallStream` needs no parsing:
under a named tool_choice the whole output is the one call's arguments.

A call cut short (max_tokens inside its arguments) is still a call, streamed or not: a stream has sent its name
and first arguments before the cut, and a whole answer says the same, so both agree on whether a call was made.
Its arguments are what was written, and `complete` is False, so no face reports it as a finished call
(chat's finish_reason stays "length", not "tool_calls").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from paged_backend.server.tool_parsers.base import (
    ExtractedToolCalls,
    PartialCall,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    new_tool_call_id,
)
from paged_backend.server.tool_parsers.json_scan import MalformedToolCall


@dataclass
class _SentCall:
    id: str
    arguments_sent: int


@dataclass
class ParsedToolCallStream:
    """Tool calls a parser finds in the text; at most `max_calls` of them (parallel_tool_calls=false: 1)."""

    parser: ToolParser
    max_calls: int | None = None
    text: str = ""
    content_sent: int = 0
    sent: list[_SentCall] = field(default_factory=list)
    complete: bool = True  # set by finish(): False when calls went out but the finished text is not whole calls

    @property
    def called(self) -> bool:
        return bool(self.sent)

    def feed(self, delta: str) -> StreamDelta:
        self.text += delta
        try:
            content_end, calls = self.parser.parse(self.text, final=False)
        except MalformedToolCall:
            return StreamDelta()  # hold back: finish() sends it as content if no call ever went out
        return self._grown(content_end, calls)

    def finish(self) -> StreamDelta:
        """What is left once generation ended; malformed calls come out as content, as the whole answer does."""
        try:
            content_end, calls = self.parser.parse(self.text, final=True)
        except MalformedToolCall:
            calls = []
        if calls:
            return self._grown(content_end, calls)
        if self.sent:
            self.complete = False
            return StreamDelta()  # calls already went out (one cut short); nothing truthful can be added
        rest, self.content_sent = self.text[self.content_sent :], len(self.text)
        return StreamDelta(content=rest)

    def extract(self, text: str) -> ExtractedToolCalls:
        """The calls of a finished output; one cut short is read as a stream would have sent it (see above)."""
        extracted = self.parser.extract(text)
        if not extracted.tool_calls:
            extracted = self._cut_short(text) or extracted
        extracted.tool_calls = extracted.tool_calls[: self.max_calls]
        return extracted

    def _cut_short(self, text: str) -> ExtractedToolCalls | None:
        """Calls begun but not finished: those whose name was written, with their arguments so far (what feed()
        would have sent), or None when the text holds no such call."""
        try:
            content_end, partial = self.parser.parse(text, final=False)
        except MalformedToolCall:
            return None
        calls = []
        for call in partial:
            if call.name is None:
                break
            calls.append(ToolCall(call.name, call.arguments or ""))
        if not calls:
            return None
        content = text[:content_end]
        return ExtractedToolCalls(content if content.strip() else None, calls, complete=False)

    def _grown(self, content_end: int, calls: list[PartialCall]) -> StreamDelta:
        grown = StreamDelta()
        # Whitespace alone before a call is not content (extract() answers null then), so it waits.
        if content_end > self.content_sent and self.text[:content_end].strip():
            grown.content, self.content_sent = self.text[self.content_sent : content_end], content_end
        for index, call in enumerate(calls[: self.max_calls]):
            arguments = call.arguments or ""
            if index == len(self.sent):
                if call.name is None:
                    break
                self.sent.append(_SentCall(new_tool_call_id(), len(arguments)))
                grown.tool_calls.append(ToolCallDelta(index, arguments, self.sent[index].id, call.name))
            elif len(arguments) > self.sent[index].arguments_sent:
                grown.tool_calls.append(ToolCallDelta(index, arguments[self.sent[index].arguments_sent :]))
                self.sent[index].arguments_sent = len(arguments)
        return grown


@dataclass
class NamedToolCallStream:
    """tool_choice naming one function: the constrained output is that call's arguments, streamed as they come."""

    name: str
    id: str = field(default_factory=new_tool_call_id)
    called: bool = False
    text: str = ""

    @property
    def complete(self) -> bool:
        """The arguments are whole JSON (the grammar's end was reached, not max_tokens)."""
        return _is_json(self.text)

    def feed(self, delta: str) -> StreamDelta:
        self.text += delta
        if not self.called:
            self.called = True
            return StreamDelta(tool_calls=[ToolCallDelta(0, delta, self.id, self.name)])
        return StreamDelta(tool_calls=[ToolCallDelta(0, delta)] if delta else [])

    def finish(self) -> StreamDelta:
        return StreamDelta()

    def extract(self, text: str) -> ExtractedToolCalls:
        return ExtractedToolCalls(None, [ToolCall(self.name, text, self.id)], complete=_is_json(text))


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
