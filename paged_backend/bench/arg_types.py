"""argparse types of the benchmarks' own flags: a bad value is argparse's one-line usage error naming the flag,
not a traceback minutes into a run (`--num-requests -5` failed in max(), `--threads 0` in torch)."""

from __future__ import annotations

import argparse
from pathlib import Path


def count(text: str, minimum: int = 1) -> int:
    """A whole number of at least `minimum`."""
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least {minimum}, got {text!r}")
    return value


def vocabulary(text: str) -> int:
    """The synthetic model's vocabulary: at least the byte tokenizer's ids, up to its special tokens (253-255; the
    pad id is an embedding row)."""
    from paged_backend.worker.models import SPECIAL_TOKENS  # here: the flags parse without loading transformers

    return count(text, max(SPECIAL_TOKENS.values()) + 1)


def count_or_zero(text: str) -> int:
    """A whole number of at least 0."""
    return 0 if text.strip() == "0" else count(text)


def counts(text: str) -> str:
    """A comma list of whole numbers of at least 1 (`default` allowed too, where the flag says so), kept as text."""
    for item in text.split(","):
        if item.strip() != "default":
            count(item.strip())
    return text


def writable_file(text: str) -> str:
    """A file path whose folder exists (checked before the run, not when the results are written); '' for none."""
    if text and not Path(text).resolve().parent.is_dir():
        raise argparse.ArgumentTypeError(f"the folder of {text!r} does not exist; create it or write elsewhere")
    return text
