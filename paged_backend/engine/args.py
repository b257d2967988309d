"""Engine flags shared by every face that starts an Engine: vLLM flag names, mapped 1:1 onto EngineConfig.

Each option defaults to None so an unset flag keeps the config's own default (one source of truth).

>>> EngineArgs(block_size=8, max_num_seqs=4).to_engine_config().cache.block_size
8
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Annotated

import typer

from paged_backend.config import EngineConfig

Model = Annotated[
    str | None, typer.Option("--model", help="local directory or hub id; omit for the embedded tiny model")
]
Models = Annotated[
    list[str] | None,
    typer.Option("--model", help="local directory or hub id, repeatable (several models); omit for the embedded one"),
]
BlockSize = Annotated[int | None, typer.Option("--block-size", help="tokens per KV block (power of two, 1..256)")]
NumBlocks = Annotated[
    int | None, typer.Option("--num-blocks", help="KV pool size in blocks; overrides the memory budget")
]
MaxNumSeqs = Annotated[int | None, typer.Option("--max-num-seqs", help="most sequences in one step")]
MaxNumBatchedTokens = Annotated[int | None, typer.Option("--max-num-batched-tokens", help="most tokens in one step")]
MaxModelLen = Annotated[int | None, typer.Option("--max-model-len", help="longest prompt + output")]
SwapSpace = Annotated[float | None, typer.Option("--swap-space", help="GiB of CPU memory for swapped-out KV blocks")]
EnablePrefixCaching = Annotated[
    bool | None,
    typer.Option("--enable-prefix-caching/--no-enable-prefix-caching", help="share identical prompt blocks"),
]
Dtype = Annotated[str | None, typer.Option("--dtype", help="auto | float32 | float16 | bfloat16")]
Device = Annotated[str | None, typer.Option("--device", help="auto | cpu | cuda | cuda:N")]
Seed = Annotated[int | None, typer.Option("--seed", help="global random seed")]
Quantization = Annotated[
    str | None,
    typer.Option("--quantization", "-q", help="awq | gptq | fp8 | bitsandbytes | compressed-tensors | torchao"),
]
QuantizationParam = Annotated[
    str | None, typer.Option("--quantization-param", help="scheme, e.g. int8_weight_only | int4_weight_only | nf4")
]
KvCacheDtype = Annotated[
    str | None, typer.Option("--kv-cache-dtype", help="auto | bfloat16 | float16 | float32 | fp8 | fp8_e4m3 | fp8_e5m2")
]
CalculateKvScales = Annotated[
    bool | None,
    typer.Option("--calculate-kv-scales/--no-calculate-kv-scales", help="fp8 KV: per-layer scales from the first step"),
]
GpuMemoryUtilization = Annotated[
    float | None, typer.Option("--gpu-memory-utilization", help="fraction of free device memory for the KV pool")
]
EnableLora = Annotated[bool, typer.Option("--enable-lora", help="serve LoRA adapters (vLLM's flag)")]
MaxLoras = Annotated[int | None, typer.Option("--max-loras", help="most LoRA adapters in one batch")]
MaxLoraRank = Annotated[int | None, typer.Option("--max-lora-rank", help="largest LoRA rank accepted")]
LoraModules = Annotated[
    list[str] | None,
    typer.Option("--lora-modules", help='adapter as name=path or {"name":..,"path":..}; repeatable'),
]
SpeculativeConfigJson = Annotated[
    str | None,
    typer.Option(
        "--speculative-config",
        help='JSON, e.g. {"method": "ngram", "num_speculative_tokens": 3} or {"model": PATH, "num_speculative_tokens": 3}',
    ),
]
EnforceEager = Annotated[
    bool,
    typer.Option(
        "--enforce-eager", help="vLLM's flag: no CUDA graphs or compiled steps (every step already runs eagerly)"
    ),
]

# Bigger than one device, through accelerate (paged_backend.worker.offload).
DeviceMap = Annotated[
    str | None,
    typer.Option("--device-map", help="accelerate placement: auto | balanced | sequential | JSON {module: device}"),
]
MaxMemory = Annotated[
    str | None, typer.Option("--max-memory", help="accelerate's memory per device: 0=20GiB,cpu=60GiB (or JSON)")
]
CpuOffloadGb = Annotated[
    float | None,
    typer.Option("--cpu-offload-gb", help="GiB of weights moved off the device: GPU -> CPU memory (on CPU: -> disk)"),
]
OffloadFolder = Annotated[
    str | None,
    typer.Option("--offload-folder", help="folder for disk-offloaded weights of non-safetensors checkpoints"),
]
TensorParallelSize = Annotated[
    int | None, typer.Option("--tensor-parallel-size", "-tp", help="ranks that split every layer's heads and MLP")
]
PipelineParallelSize = Annotated[
    int | None, typer.Option("--pipeline-parallel-size", "-pp", help="stages that split the decoder layers")
]
DistributedExecutorBackend = Annotated[
    str | None,
    typer.Option(
        "--distributed-executor-backend", help="mp | ray; default: mp, or torchrun's ranks when run under torchrun"
    ),
]
DistributedTimeoutSeconds = Annotated[
    float | None,
    typer.Option("--distributed-timeout-seconds", help="seconds a collective waits for a rank before failing"),
]


@dataclass
class EngineArgs:
    """Values of the engine flags; None means 'not given on the command line'."""

    model: str | None = None
    block_size: int | None = None
    num_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    swap_space: float | None = None
    enable_prefix_caching: bool | None = None
    dtype: str | None = None
    device: str | None = None
    seed: int | None = None
    gpu_memory_utilization: float | None = None
    device_map: str | None = None
    max_memory: str | None = None
    cpu_offload_gb: float | None = None
    offload_folder: str | None = None
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    distributed_executor_backend: str | None = None
    distributed_timeout_seconds: float | None = None
    quantization: str | None = None
    quantization_param: str | None = None
    cache_dtype: str | None = None  # --kv-cache-dtype
    calculate_kv_scales: bool | None = None
    enable_lora: bool | None = None
    max_loras: int | None = None
    max_lora_rank: int | None = None
    lora_modules: dict[str, str] | None = None
    speculative_config: str | None = None  # --speculative-config JSON
    enforce_eager: bool | None = None

    def to_engine_config(self) -> EngineConfig:
        """The config with every given flag set on the field of the same name."""
        from paged_backend.engine import engine_config  # the engine (transformers models) loads only when used

        return engine_config(**{name: value for name, value in asdict(self).items() if value is not None})


def set_lora_args(args: EngineArgs, enable_lora, max_loras, max_lora_rank, lora_modules: list[str] | None) -> None:
    """The LoRA flags onto `args`; `--lora-modules` values are parsed (raises InvalidRequest on a bad one)."""
    from paged_backend.lora.request import parse_lora_modules

    args.enable_lora, args.max_loras, args.max_lora_rank = enable_lora or None, max_loras, max_lora_rank
    args.lora_modules = parse_lora_modules(lora_modules) if lora_modules else None
