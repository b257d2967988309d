"""TGI's error kinds: each maps to one HTTP status and one `error_type` string (router `InferError`)."""

from __future__ import annotations


class TgiError(Exception):
    """An error the HTTP face reports as `{"error": message, "error_type": error_type}`."""

    status_code = 500
    error_type = "unknown"
    prefix = ""  # what TGI's router writes before the error's own text
    default_message = ""  # the text when none is given

    def __init__(self, message: str | None = None) -> None:
        super().__init__(self.default_message if message is None else message)

    @property
    def message(self) -> str:
        return f"{self.prefix}{self}"

    def body(self) -> dict[str, str]:
        return {"error": self.message, "error_type": self.error_type}


class ValidationError(TgiError):
    status_code = 422
    error_type = "validation"
    prefix = "Input validation error: "


class GenerationError(TgiError):
    status_code = 424
    error_type = "generation"
    prefix = "Request failed during generation: Server error: "


class OverloadedError(TgiError):
    status_code = 429
    error_type = "overloaded"
    default_message = "Model is overloaded"


class IncompleteGenerationError(TgiError):
    status_code = 500
    error_type = "incomplete_generation"


class TemplateError(TgiError):
    status_code = 422
    error_type = "template_error"


class ToolError(TgiError):
    status_code = 422
    error_type = "tool_error"
    prefix = "Tool error: "


class UnhealthyError(TgiError):
    status_code = 503
    error_type = "healthcheck"
    default_message = "unhealthy"
