"""TGI's error kinds: each maps to one HTTP status and one `error_type` string (router `InferError`)."""

from __future__ import annotations


class TgiError(Exception):
    """An error the HTTP face reports as `{"error": message, "error_type": error_type}`.

    A kind declares its status, `error_type`, the `prefix` TGI's router writes before the error's own text and
    the `default_message` used when none is given, as class keywords: `class X(TgiError, status_code=422, ...)`.
    """

    status_code: int
    error_type: str
    prefix: str
    default_message: str

    def __init_subclass__(
        cls, *, status_code: int, error_type: str, prefix: str = "", default_message: str = "", **kwargs
    ) -> None:
        super().__init_subclass__(**kwargs)
        cls.status_code, cls.error_type = status_code, error_type
        cls.prefix, cls.default_message = prefix, default_message

    def __init__(self, message: str | None = None) -> None:
        super().__init__(self.default_message if message is None else message)

    @property
    def message(self) -> str:
        return f"{self.prefix}{self}"

    def body(self) -> dict[str, str]:
        return {"error": self.message, "error_type": self.error_type}


class ValidationError(TgiError, status_code=422, error_type="validation", prefix="Input validation error: "):
    """A request TGI refuses as it stands: its parameters, its length, its grammar."""


class GenerationError(
    TgiError, status_code=424, error_type="generation", prefix="Request failed during generation: Server error: "
):
    """A backend failed while generating."""


class OverloadedError(TgiError, status_code=429, error_type="overloaded", default_message="Model is overloaded"):
    """More requests in flight than --max-concurrent-requests."""


class IncompleteGenerationError(TgiError, status_code=500, error_type="incomplete_generation"):
    """A stream ended without its final token."""


class TemplateError(TgiError, status_code=422, error_type="template_error"):
    """The chat template failed to render the messages."""


class ToolError(TgiError, status_code=422, error_type="tool_error", prefix="Tool error: "):
    """`tools` or `tool_choice` in a form TGI refuses."""


class UnhealthyError(TgiError, status_code=503, error_type="healthcheck", default_message="unhealthy"):
    """The backend failed its health check."""
