"""TGI's spellings of engine settings, translated once for the launcher and the shard."""

from __future__ import annotations


def kv_cache_dtype(name: str | None) -> str:
    """`--kv-cache-dtype`: TGI spells fp8 variants after torch dtypes (`fp8_e4m3fn`); the pool knows vLLM's names.

    >>> kv_cache_dtype("fp8_e4m3fn"), kv_cache_dtype(None)
    ('fp8', 'auto')
    """
    return {"fp8_e4m3fn": "fp8"}.get(name, name) if name else "auto"
