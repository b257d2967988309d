"""Router limits and identity the HTTP face enforces (TGI router flags, same names and defaults)."""

from __future__ import annotations

from dataclasses import Field, dataclass, field, fields

from paged_backend.worker.default_model import TINY_MODEL


def _router_flag(default, help: str):
    """A setting the launcher's TGI flag of the same name gives as it is; the flag takes this default and help."""
    return field(default=default, metadata={"help": help})


@dataclass
class RouterSettings:
    model_id: str = TINY_MODEL  # the launcher sets the model it serves
    max_concurrent_requests: int = _router_flag(128, "requests in flight before 429 overloaded")
    max_best_of: int = _router_flag(2, "largest best_of accepted")
    max_stop_sequences: int = _router_flag(4, "most stop sequences per request")
    max_top_n_tokens: int = _router_flag(5, "largest top_n_tokens accepted")
    # The launcher derives these two from --max-input-tokens / --max-total-tokens and the backend's context.
    max_input_tokens: int = 1023
    max_total_tokens: int = 1024
    max_client_batch_size: int = _router_flag(4, "most prompts in one /v1/completions call")
    validation_workers: int = _router_flag(2, "reported in /info; validation runs on the event loop")
    api_key: str | None = _router_flag(None, "require `Authorization: Bearer <key>` on generate routes")
    payload_limit: int = _router_flag(2_000_000, "largest request body in bytes (413 above)")
    disable_grammar_support: bool = _router_flag(False, "refuse the `grammar` parameter (and tools, response_format)")
    # `/` without return_full_text: TGI prepends the prompt for text-generation models (and local paths).
    compat_return_full_text: bool = True


# The settings a TGI flag of the same name gives as it is, by field name.
ROUTER_FLAG_FIELDS: dict[str, Field] = {each.name: each for each in fields(RouterSettings) if "help" in each.metadata}
