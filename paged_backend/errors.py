"""Errors a user can cause. Each message says what to change; servers map them to 4xx."""


class PagedBackendError(Exception):
    """Base class: every error here is the caller's to fix, never a crash of ours."""


class OutOfBlocks(PagedBackendError):
    """The KV pool has too few free blocks for the request."""


class PromptTooLong(PagedBackendError):
    """The prompt (plus requested output) exceeds the model or pool limit."""


class InvalidRequest(PagedBackendError):
    """A request or sampling parameter has an invalid value."""


class BackendUnavailable(PagedBackendError):
    """An attention backend was asked for but cannot run here."""


class UnsupportedModel(PagedBackendError):
    """The model uses a feature paged attention does not implement."""


class BadLoRAAdapter(InvalidRequest):
    """A LoRA adapter is missing, malformed, too large for `max_lora_rank`, or targets modules the model lacks."""


def not_unicode(text: str) -> str | None:
    """Why `text` cannot be UTF-8, or None: JSON's escapes let a lone surrogate ("\\ud800") through, and no tokenizer
    encodes one."""
    try:
        text.encode()
    except UnicodeEncodeError as error:
        return error.reason
    return None


def one_line(error: Exception, flags: dict[str, str] | None = None) -> str:
    """`error` for a command line: a config's pydantic ValidationError as the flags to change (`--num-blocks: Input
    should be greater than or equal to 2, got 1`), one line for all; any other error as its message. `flags` names
    the flag that set a field where it is not the field's own (`launch --max-batch-size` sets `max_num_seqs`)."""
    from pydantic import ValidationError

    if not isinstance(error, ValidationError):
        return str(error)
    parts = []
    for item in error.errors():
        names = [part for part in item["loc"] if isinstance(part, str)]
        given = repr(item.get("input"))
        where = (flags or {}).get(names[-1]) or f"--{names[-1].replace('_', '-')}" if names else error.title
        parts.append(f"{where}: {item['msg']}" + (f", got {given}" if len(given) <= 60 else ""))
    return "; ".join(parts)
