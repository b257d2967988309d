"""TGI's error kinds: each maps to one HTTP status and one `error_type` string (router `InferError`)."""

from __future__ import annotations


class TgiError(Exception):
    """An error the HTTP face reports as `{"error": message, "error_type": error_type}`."""

    status_code = 500
    error_type = "unknown"

    @property
    def message(self) -> str:
        return str(self)

    def body(self) -> dict[str, str]:
        return {"error": self.message, "error_type": self.error_type}


class ValidationError(TgiError):
    status_code = 422
    error_type = "validation"

    @property
    def message(self) -> str:
        return f"Input validation error: {self}"


class GenerationError(TgiError):
    status_code = 424
    error_type = "generation"

    @property
    def message(self) -> str:
        return f"Request failed during generation: Server error: {self}"


class OverloadedError(TgiError):
    status_code = 429
    error_type = "overloaded"

    def __init__(self, message: str = "Model is overloaded") -> None:
        super().__init__(message)


class IncompleteGenerationError(TgiError):
    status_code = 500
    error_type = "incomplete_generation"


class TemplateError(TgiError):
    status_code = 422
    error_type = "template_error"


class ToolError(TgiError):
    status_code = 422
    error_type = "tool_error"

    @property
    def message(self) -> str:
        return f"Tool error: {self}"


class UnhealthyError(TgiError):
    status_code = 503
    error_type = "healthcheck"

    def __init__(self, message: str = "unhealthy") -> None:
        super().__init__(message)
