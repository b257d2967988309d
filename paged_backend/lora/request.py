"""`LoRARequest`: which adapter a request runs with (vLLM's names and order of fields)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from paged_backend.errors import InvalidRequest


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
        if not self.lora_name:
            raise InvalidRequest("LoRARequest needs a lora_name")
        if self.lora_int_id < 1:
            raise InvalidRequest(f"lora_int_id must be a positive integer, got {self.lora_int_id}")


def parse_lora_modules(values: list[str]) -> dict[str, str]:
    """`--lora-modules` values, vLLM's two forms: `name=path`, or JSON `{"name": ..., "path": ...}`.

    >>> parse_lora_modules(['sql=/a/sql', '{"name": "chat", "path": "/a/chat"}'])
    {'sql': '/a/sql', 'chat': '/a/chat'}
    """
    modules: dict[str, str] = {}
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                entry = json.loads(value)
                name, path = entry["name"], entry["path"]
            except (ValueError, KeyError, TypeError) as error:
                raise InvalidRequest(f"--lora-modules {value!r}: JSON form needs 'name' and 'path'") from error
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise InvalidRequest(f"--lora-modules {value!r}: give name=path")
        if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
            raise InvalidRequest(f"--lora-modules {value!r}: 'name' and 'path' must be non-empty strings")
        if modules.get(name, path) != path:  # the same adapter twice is harmless; two under one name is not
            raise InvalidRequest(f"--lora-modules names {name!r} twice ({modules[name]} and {path}); give each "
                                 f"adapter its own name")  # fmt: skip
        modules[name] = path
    return modules
