"""Environment switches, each read one way: a value that is not a boolean (or not one of a switch's choices) is an
error naming the variable, never silently "off"."""

from __future__ import annotations

import os

from paged_backend.errors import InvalidRequest

TRUE = frozenset({"1", "true", "yes", "on"})
FALSE = frozenset({"0", "false", "no", "off"})


def switch_value(text: str) -> bool | None:
    """A switch's text as a boolean, or None when it spells neither (the caller says whose value it was)."""
    word = text.strip().lower()
    return True if word in TRUE else False if word in FALSE else None


def env_flag(name: str, default: bool) -> bool:
    """`name` as a boolean; unset or empty is `default`."""
    raw = os.environ.get(name, "")
    if not raw.strip():
        return default
    if (value := switch_value(raw)) is not None:
        return value
    raise InvalidRequest(f"{name}={os.environ[name]!r} is not a boolean: set it to 1 or 0 (true/false, yes/no, on/off), "
                         f"or unset it")  # fmt: skip


def env_choice(name: str, choices: tuple[str, ...]) -> str | None:
    """`name` as one of `choices`; unset or empty is None."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    if raw not in choices:
        raise InvalidRequest(f"{name}={raw!r} is not one of {', '.join(choices)}: set one of them, or unset it")
    return raw


def env_fraction(name: str, default: float) -> float:
    """`name` as a fraction in (0, 1]; unset or empty is `default`."""
    return _env_number(name, default, lambda value: 0 < value <= 1, "a fraction in (0, 1]: set e.g. 0.9, or unset it")


def env_seconds(name: str, default: float) -> float:
    """`name` as a positive, finite number of seconds; unset or empty is `default`."""
    return _env_number(name, default, lambda value: 0 < value < float("inf"), "a positive number of seconds")


def _env_number(name: str, default: float, ok, expected: str) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")  # fails every check
    if not ok(value):
        raise InvalidRequest(f"{name}={raw!r} is not {expected}")
    return value
