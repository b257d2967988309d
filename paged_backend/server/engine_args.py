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
    enable_lora: bool | None = None
    max_loras: int | None = None
    max_lora_rank: int | None = None
    lora_modules: dict[str, str] | None = None

    def to_engine_config(self) -> EngineConfig:
        """The config with every given flag set on the field of the same name."""
        from paged_backend.engine import engine_config  # the engine (transformers models) loads only when used

        return engine_config(**{name: value for name, value in asdict(self).items() if value is not None})


def set_lora_args(args: EngineArgs, enable_lora, max_loras, max_lora_rank, lora_modules: list[str] | None) -> None:
    """The LoRA flags onto `args`; `--lora-modules` values are parsed (raises InvalidRequest on a bad one)."""
    from paged_backend.lora.request import parse_lora_modules

    args.enable_lora, args.max_loras, args.max_lora_rank = enable_lora or None, max_loras, max_lora_rank
    args.lora_modules = parse_lora_modules(lora_modules) if lora_modules else None
