"""User-facing configuration. CLI flags map 1:1 onto these fields (vLLM / TGI names where they exist)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class CacheConfig(_Config):
    block_size: int = Field(16, description="tokens per KV block (power of two, 1..256)")
    num_blocks: int | None = Field(None, ge=2, description="pool size in blocks; overrides the memory budget")
    kv_cache_memory_bytes: int | None = Field(None, gt=0, description="pool size in bytes")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="fraction of free device memory for KV")
    swap_space: float = Field(0.0, ge=0, description="GiB of CPU memory for swapped-out KV blocks")
    cache_dtype: str = Field("auto", description="auto | float16 | bfloat16 | float32 | fp8")
    enable_prefix_caching: bool = True
    watermark: float = Field(0.01, ge=0, lt=1, description="fraction of blocks kept free at admission")

    @model_validator(mode="after")
    def _check_block_size(self):
        bs = self.block_size
        if bs < 1 or bs > 256 or bs & (bs - 1):
            raise ValueError(f"block_size must be a power of two between 1 and 256, got {bs}")
        return self


class SchedulerConfig(_Config):
    max_num_seqs: int = Field(256, ge=1, description="most sequences in one step")
    max_num_batched_tokens: int = Field(2048, ge=1, description="most tokens in one step (prefill chunks included)")
    max_model_len: int | None = Field(None, ge=1, description="longest prompt + output; default: the model's")
    enable_chunked_prefill: bool = True
    policy: Literal["fcfs", "priority"] = "fcfs"
    preemption_mode: Literal["recompute", "swap"] | None = Field(
        None, description="default: swap when swap_space > 0, else recompute"
    )


class EngineConfig(_Config):
    model: str | None = Field(None, description="local directory or hub id; None = the embedded tiny model")
    tokenizer: str | None = None
    dtype: str = Field("auto", description="auto | float32 | float16 | bfloat16")
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N")
    seed: int = 0
    attention_backend: Literal["auto", "torch", "cpu", "triton", "cuda"] = "auto"
    enable_lora: bool = False
    max_loras: int = Field(1, ge=1, description="most LoRA adapters in one step (device slots, evicted LRU)")
    max_lora_rank: int = Field(16, ge=1, description="largest LoRA rank accepted")
    lora_modules: dict[str, str] = Field(default_factory=dict, description="adapter name -> peft directory")
    cache: CacheConfig = Field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
