"""The class of service of the request being handled, for the scheduler.

"interactive" (the default) is every client's request; "batch" runs only on capacity interactive traffic leaves
over and is preempted first. No request field sets it: the batch API sets it around the calls it makes in
process, and `Generation` reads it when it adds the request to the engine.
"""

from __future__ import annotations

from contextvars import ContextVar

from paged_backend.engine.request import RequestClass

__all__ = ["REQUEST_CLASS", "RequestClass"]

REQUEST_CLASS: ContextVar[RequestClass] = ContextVar("request_class", default="interactive")
