"""LoRA adapters served side by side: many adapters and the base model mixed in one packed step.

`LoRARequest` names an adapter (vLLM's fields); `LoRAManager` loads adapters (peft format), keeps up to
`max_loras` of them in device slots (LRU) and applies each row's low-rank update on top of the shared base
projections during the engine's own forwards.
"""

from paged_backend.lora.adapter import LoRAAdapter, load_adapter
from paged_backend.lora.manager import LoRAManager
from paged_backend.lora.request import LoRARequest

__all__ = ["LoRAAdapter", "LoRAManager", "LoRARequest", "load_adapter"]
