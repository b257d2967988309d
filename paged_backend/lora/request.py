"""`LoRARequest`: which adapter a request runs with (vLLM's names and order of fields)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, a positive integer id, and the peft directory it loads from.

    >>> LoRARequest("sql", 1, "/adapters/sql").lora_name
    'sql'
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        from paged_backend.errors import InvalidRequest

        if not self.lora_name:
            raise InvalidRequest("LoRARequest needs a lora_name")
        if self.lora_int_id < 1:
            raise InvalidRequest(f"lora_int_id must be a positive integer, got {self.lora_int_id}")
