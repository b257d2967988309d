"""Router limits and identity the HTTP face enforces (TGI router flags, same names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass

# The model id that names the embedded tiny model (what --model-id / MODEL_ID default to).
EMBEDDED_MODEL_ID = "paged-backend/embedded-tiny"


def model_to_load(model_id: str | None) -> str | None:
    """What `paged_backend.worker.models.load_model` takes: None for the embedded model."""
    return None if model_id in (None, EMBEDDED_MODEL_ID) else model_id


@dataclass
class RouterSettings:
    model_id: str = EMBEDDED_MODEL_ID
    max_concurrent_requests: int = 128
    max_best_of: int = 2
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5
    max_input_tokens: int = 1023
    max_total_tokens: int = 1024
    max_client_batch_size: int = 4
    validation_workers: int = 2
    api_key: str | None = None
    payload_limit: int = 2_000_000
    disable_grammar_support: bool = False  # TGI's --disable-grammar-support: `grammar` is refused
    # `/` without return_full_text: TGI prepends the prompt for text-generation models (and local paths).
    compat_return_full_text: bool = True
