"""Models bigger than one device, through accelerate: device maps, memory limits and offload (CPU, disk).

transformers hands `device_map` / `max_memory` / `offload_folder` to accelerate, which places each module on a
device (or in CPU memory / on disk) and hooks its forward so its weights reach the *execution device* in time.
The paged pool then keeps each layer's KV on that layer's execution device (`layer_devices`).

`cpu_offload_gb` (vLLM's name) moves that many GiB of weights off the execution device to the next tier down:
from the GPU to CPU memory, or, when the model runs on the CPU, from CPU memory to disk.
"""

from __future__ import annotations

import torch

from paged_backend.config.placement import parse_device_map, parse_max_memory
from paged_backend.errors import InvalidRequest

GIB = 1 << 30


def uses_accelerate(device_map, max_memory, cpu_offload_gb: float) -> bool:
    return device_map is not None or max_memory is not None or cpu_offload_gb > 0


def dispatch_kwargs(
    source: str,
    dtype: torch.dtype,
    device: torch.device,
    *,
    device_map=None,
    max_memory=None,
    cpu_offload_gb: float = 0.0,
    offload_folder: str | None = None,
    trust_remote_code: bool = False,
) -> dict:
    """The `from_pretrained` keyword arguments that place the model with accelerate."""
    try:
        import accelerate  # noqa: F401
    except ImportError as error:
        raise InvalidRequest(
            "device maps, max memory and offload need accelerate: pip install 'paged-backend[accelerate]'"
        ) from error
    device_map = parse_device_map(device_map)
    max_memory = parse_max_memory(max_memory)
    if cpu_offload_gb > 0:
        if max_memory is not None:
            raise InvalidRequest(
                "give either --cpu-offload-gb or --max-memory, not both (both set how much stays on the device)"
            )
        max_memory = _offload_budget(source, dtype, device, cpu_offload_gb, trust_remote_code)
    kwargs = dict(device_map=device_map or "auto", max_memory=max_memory)
    if offload_folder is not None:  # safetensors checkpoints offload to disk in place; others need a folder
        kwargs["offload_folder"] = offload_folder
    return kwargs


def _offload_budget(
    source: str, dtype: torch.dtype, device: torch.device, cpu_offload_gb: float, trust_remote_code: bool = False
) -> dict:
    """max_memory that keeps (weights - cpu_offload_gb) on the execution device and the rest one tier down."""
    from accelerate import init_empty_weights
    from accelerate.utils import compute_module_sizes
    from transformers import AutoConfig, AutoModelForCausalLM

    with init_empty_weights():
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
        empty = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    weights = compute_module_sizes(empty, dtype=dtype)[""]
    keep = max(weights - int(cpu_offload_gb * GIB), 0)
    if device.type == "cuda":
        from paged_backend.core.kv_budget import available_memory

        return {device.index or 0: keep, "cpu": available_memory(torch.device("cpu"))}
    return {"cpu": keep}


def execution_device(module: torch.nn.Module) -> torch.device:
    """Where `module` computes: its accelerate hook's execution device, else where its weights are."""
    hook = getattr(module, "_hf_hook", None)
    for candidate in [hook, *getattr(hook, "hooks", [])]:
        device = getattr(candidate, "execution_device", None)
        if device is not None:
            return torch.device(f"cuda:{device}" if isinstance(device, int) else device)
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")


def input_device(model: torch.nn.Module) -> torch.device:
    """The device a model's input ids go to (the embedding's; for a plain model, `model.device`)."""
    if not getattr(model, "hf_device_map", None):
        return model.device
    return execution_device(model.get_input_embeddings())


def layer_devices(model: torch.nn.Module, num_layers: int) -> list[torch.device] | None:
    """Execution device of each attention layer of a dispatched model; None for a model on one device."""
    if not getattr(model, "hf_device_map", None):
        return None
    devices: dict[int, torch.device] = {}
    for module in model.modules():
        layer_idx = getattr(module, "layer_idx", None)
        if isinstance(layer_idx, int) and type(module).__name__.endswith("Attention"):
            devices.setdefault(layer_idx, execution_device(module))
    missing = [i for i in range(num_layers) if i not in devices]
    if missing:
        fallback = input_device(model)
        devices.update(dict.fromkeys(missing, fallback))
    return [devices[i] for i in range(num_layers)]
