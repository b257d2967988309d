"""TGI's LoRA surface on the paged backend: `--lora-adapters id=path,...` and the request's `adapter_id`.

TGI loads every listed adapter at start and has no rank or slot limits, so the engine gets one slot per
adapter and the largest rank among them. An `adapter_id` of None, "" or the model id runs the base model.
"""

from __future__ import annotations

import json
from pathlib import Path

from paged_backend.lora import LoRARequest
from paged_backend.lora.adapter import CONFIG_FILE
from paged_backend.lora.manager import served_adapters
from paged_backend.tgi.http.errors import ValidationError


def parse_lora_adapters(value: str) -> dict[str, str]:
    """`id=path,id2=path2` (a bare entry is a directory that is also its id).

    >>> parse_lora_adapters("sql=/a/sql, /a/chat")
    {'sql': '/a/sql', '/a/chat': '/a/chat'}
    """
    adapters = {}
    for entry in filter(None, (part.strip() for part in value.split(","))):
        name, _, path = entry.partition("=")
        adapters[name] = path or name
    return adapters


def largest_rank(paths: list[str]) -> int:
    """The largest rank the adapters declare (their `r` and `rank_pattern`); unreadable ones fail later, clearly."""
    ranks = [16]
    for path in paths:
        config_path = Path(path) / CONFIG_FILE
        if config_path.is_file():
            config = json.loads(config_path.read_text())
            ranks += [config.get("r", 8), *(config.get("rank_pattern") or {}).values()]
    return max(ranks)


def lora_options(value: str | None) -> dict:
    """Engine options for `--lora-adapters` (none when the flag is absent)."""
    if not value:
        return {}
    adapters = parse_lora_adapters(value)
    return dict(enable_lora=True, lora_modules=adapters, max_loras=max(1, len(adapters)),
                max_lora_rank=largest_rank(list(adapters.values())))  # fmt: skip


def lora_request(engine, adapter_id: str | None, model_id: str | None) -> LoRARequest | None:
    """The adapter a request names, or None for the base model; an unknown id is a 422 naming the loaded ones."""
    if adapter_id in (None, "", model_id):
        return None
    adapter = served_adapters(engine).get(adapter_id)
    if adapter is None:
        loaded = ", ".join(sorted(served_adapters(engine))) or "none (start with --lora-adapters id=path)"
        raise ValidationError(f"adapter_id '{adapter_id}' is not loaded; loaded adapters: {loaded}")
    return LoRARequest(adapter.name, adapter.int_id, adapter.path)
