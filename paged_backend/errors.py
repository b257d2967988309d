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


# pydantic's error types for a body that is not a JSON object (FastAPI hands a non-JSON body over as raw bytes)
NOT_AN_OBJECT = frozenset({"model_attributes_type", "model_type", "dict_type"})


def body_media_type_error(content_type: str, errors: list[dict]) -> str | None:
    """The media type a JSON route's body came as, when that is why it failed validation (`text/plain` with a JSON
    body), else None. Both faces answer it in their own words. A form route's own errors (/v1/files' missing
    `purpose`) are not this: they are about a part, not the body being no object."""
    media_type = content_type.partition(";")[0].strip().lower()
    if media_type in ("", "application/json") or media_type.endswith("+json"):
        return None
    failed = any(tuple(e.get("loc", ()))[:1] == ("body",) and e.get("type") in NOT_AN_OBJECT for e in errors)
    return media_type if failed else None


def one_line(error: Exception, flags: dict[str, str] | None = None) -> str:
    """`error` for a command line: a config's pydantic ValidationError as the flags to change (`--num-blocks: Input
    should be greater than or equal to 2, got 1`), one line for all; any other error as its message. `flags` names
    the flag that set a field where it is not the field's own (`launch --max-batch-size` sets `max_num_seqs`)."""
    from pydantic import ValidationError

    if not isinstance(error, ValidationError):
        return str(error)
    parts = []
    for item in error.errors():
        names = [part for part in item["loc"] if isinstance(part, str) and part not in FLATTENED_SECTIONS]
        given = repr(item.get("input"))
        field, keys = (names[0], names[1:]) if names else (None, [])  # keys: inside a JSON-valued flag
        flag = (flags or {}).get(field) if field else None
        where = flag or (f"--{field.replace('_', '-')}" if field else error.title)
        where += "".join(f": {key}" for key in keys)
        message = item["msg"].removeprefix("Value error, ")  # pydantic's wrapping of a validator's ValueError
        parts.append(f"{where}: {message}" + (f", got {given}" if len(given) <= 60 else ""))
    return "; ".join(parts)


# The config sections whose fields are flags of their own (`cache.block_size` is `--block-size`); any other nested
# name is a key inside a JSON-valued flag (`speculative_config.method` is `--speculative-config`'s "method").
FLATTENED_SECTIONS = frozenset({"cache", "scheduler", "parallel"})
