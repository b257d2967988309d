"""Which models the paged engine can run: those whose attention goes through transformers' AttentionInterface.

The engine hands each attention layer a packed handle instead of K/V tensors; only models that call the
registered attention function pass it on untouched. transformers marks those classes with
`_supports_attention_backend = True`. A model without it (Falcon, Bloom, GPT-J, MPT, ...) computes attention
in its own code, which would fail mid-step on the handle, so it is refused when the engine loads it.
"""

from __future__ import annotations

from transformers import PreTrainedModel

from paged_backend.errors import UnsupportedModel


def check_runs_paged(model: PreTrainedModel) -> None:
    """Raise `UnsupportedModel` naming the architecture and why, when the engine cannot run `model`."""
    if getattr(type(model), "_supports_attention_backend", False):
        return
    name = type(model).__name__
    model_type = getattr(model.config, "model_type", "?")
    raise UnsupportedModel(
        f"{name} (model_type {model_type!r}) computes attention in its own code instead of through transformers' "
        f"AttentionInterface, so the paged engine cannot feed it K/V from the pool; serve a model whose class "
        f"supports attention backends, or run this one with HF generate (PagedCache, or launch --backend reference)"
    )
