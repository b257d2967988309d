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
