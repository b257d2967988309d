"""Find the extent of JSON values in text that may still be growing (a model's output mid-stream).

The scanner does not validate: it only finds where objects and their top-level values start and end, so a
tool-call parser can stream an `arguments` value as the model writes it. Complete calls are checked with
`json.loads` before they are reported.

>>> text = '{"name": "f", "arguments": {"x": [1'
>>> found = scan_object(text, 0)
>>> found.end is None, text[found.fields["arguments"].start :]
(True, '{"x": [1')
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

WHITESPACE = " \t\r\n"


class MalformedToolCall(ValueError):
    """The text cannot be (or become) the tool-call JSON the format expects."""


@dataclass
class Span:
    start: int
    end: int | None  # one past the value's last character; None while the value is still open


@dataclass
class ScannedObject:
    start: int
    end: int | None  # one past the closing brace; None while the object is still open
    fields: dict[str, Span] = field(default_factory=dict)  # top-level keys whose value has begun


def skip_whitespace(text: str, index: int) -> int:
    while index < len(text) and text[index] in WHITESPACE:
        index += 1
    return index


def scan_string(text: str, start: int) -> int | None:
    """End of the JSON string opening at `start` (a quote), or None if it has not closed yet."""
    index = start + 1
    while index < len(text):
        char = text[index]
        if char == "\\":
            index += 2
            continue
        if char == '"':
            return index + 1
        index += 1
    return None


def scan_value(text: str, start: int) -> int | None:
    """End of the JSON value starting at `start`, or None if the text ends inside it."""
    opener = text[start]
    if opener == '"':
        return scan_string(text, start)
    if opener in "{[":
        depth, index = 0, start
        while index < len(text):
            char = text[index]
            if char == '"':
                end = scan_string(text, index)
                if end is None:
                    return None
                index = end
                continue
            if char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    return index + 1
            index += 1
        return None
    if opener in ",:}]":
        raise MalformedToolCall(f"expected a JSON value at offset {start}, found {opener!r}")
    index = start  # a number, true, false or null: it ends where a delimiter begins
    while index < len(text) and text[index] not in ",}]" + WHITESPACE:
        index += 1
    return index if index < len(text) else None


def scan_object(text: str, start: int) -> ScannedObject:
    """The object opening at `text[start] == '{'`: its top-level fields so far and, once closed, its end."""
    found = ScannedObject(start, None)
    index = skip_whitespace(text, start + 1)
    if index < len(text) and text[index] == "}":
        found.end = index + 1
        return found
    while index < len(text):
        if text[index] != '"':
            raise MalformedToolCall(f"expected a quoted key at offset {index}, found {text[index]!r}")
        key_end = scan_string(text, index)
        if key_end is None:
            return found
        key = _decode_string(text[index:key_end])
        index = skip_whitespace(text, key_end)
        if index >= len(text):
            return found
        if text[index] != ":":
            raise MalformedToolCall(f"expected ':' after key {key!r}, found {text[index]!r}")
        index = skip_whitespace(text, index + 1)
        if index >= len(text):
            return found
        value_end = scan_value(text, index)
        found.fields[key] = Span(index, value_end)
        if value_end is None:
            return found
        index = skip_whitespace(text, value_end)
        if index >= len(text):
            return found
        if text[index] == "}":
            found.end = index + 1
            return found
        if text[index] != ",":
            raise MalformedToolCall(f"expected ',' or '}}' after the value of {key!r}, found {text[index]!r}")
        index = skip_whitespace(text, index + 1)
    return found


def scan_objects(text: str, start: int, separator: str) -> tuple[list[ScannedObject], int]:
    """Objects one after another from `start`, joined by `separator` (and whitespace).

    Returns them and the offset where the sequence stopped: the end of the text, or the first character that
    neither starts an object nor separates two.
    """
    objects: list[ScannedObject] = []
    index = skip_whitespace(text, start)
    while index < len(text) and text[index] == "{":
        scanned = scan_object(text, index)
        objects.append(scanned)
        if scanned.end is None:
            return objects, len(text)
        index = skip_whitespace(text, scanned.end)
        if index >= len(text) or text[index] != separator:
            return objects, index
        index = skip_whitespace(text, index + 1)
    return objects, index


def _decode_string(quoted: str) -> str:
    try:
        return json.loads(quoted)
    except ValueError as error:
        raise MalformedToolCall(f"invalid JSON string {quoted!r}: {error}") from error
