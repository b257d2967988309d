"""User-facing configuration. CLI flags map 1:1 onto these fields (vLLM / TGI names where they exist)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from paged_backend.config.env import env_flag
from paged_backend.config.generation import parse_override
from paged_backend.config.placement import parse_device_map, parse_max_memory
from paged_backend.config.speculative import SpeculativeConfig, parse_speculative_config
from paged_backend.core.kv_budget import GPU_MEMORY_UTILIZATION

BATCH_INVARIANT_ENV = "PAGED_BACKEND_BATCH_INVARIANT"  # =1 turns batch_invariant on where no flag says otherwise


TOKENIZER_MODES = ("auto", "hf")  # both load the model's fast Hugging Face tokenizer
_REFUSED_TOKENIZER_MODES = {
    "slow": "transformers 5 loads only fast tokenizers (AutoTokenizer ignores use_fast=False), so there is no slow "
    "one to load",
    "mistral": "mistral_common's tokenizer is not run by this engine",
    "custom": "this engine has no registry of custom tokenizers",
}


def check_tokenizer_mode(mode: str) -> str:
    """vLLM's --tokenizer-mode: auto and hf run (the model's fast Hugging Face tokenizer); slow, mistral and custom
    are vLLM's other modes, refused with the reason; anything else is not a mode.

    >>> check_tokenizer_mode("hf")
    'hf'
    """
    if mode in TOKENIZER_MODES:
        return mode
    supported = "use auto or hf (the model's Hugging Face tokenizer)"
    if mode in _REFUSED_TOKENIZER_MODES:
        raise ValueError(f"tokenizer mode {mode!r} is not supported: {_REFUSED_TOKENIZER_MODES[mode]}; {supported}")
    raise ValueError(f"unknown tokenizer mode {mode!r}: vLLM's modes are auto, hf, slow, mistral and custom; {supported}")


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class CacheConfig(_Config):
    block_size: int = Field(16, description="tokens per KV block (power of two, 1..256)")
    num_blocks: int | None = Field(None, ge=2, description="pool size in blocks; overrides the memory budget")
    kv_cache_memory_bytes: int | None = Field(None, gt=0, description="pool size in bytes")
    gpu_memory_utilization: float = Field(GPU_MEMORY_UTILIZATION, gt=0, le=1, description="fraction of free device memory for KV")
    swap_space: float = Field(0.0, ge=0, description="GiB of CPU memory for swapped-out KV blocks")
    cache_dtype: str = Field("auto", description="auto | float16 | bfloat16 | float32 | fp8 | fp8_e4m3 | fp8_e5m2")
    calculate_kv_scales: bool = Field(False, description="fp8 pools: per-layer K/V scales from the first step")
    enable_prefix_caching: bool = True
    watermark: float = Field(0.01, ge=0, lt=1, description="fraction of blocks kept free at admission")

    @field_validator("block_size")
    @classmethod
    def _check_block_size(cls, size: int) -> int:
        if size < 1 or size > 256 or size & (size - 1):
            raise ValueError("block_size must be a power of two between 1 and 256 (1, 2, 4, ..., 256)")
        return size


class SchedulerConfig(_Config):
    max_num_seqs: int = Field(256, ge=1, description="most sequences in one step")
    max_num_batched_tokens: int = Field(2048, ge=1, description="most tokens in one step (prefill chunks included)")
    max_model_len: int | None = Field(None, ge=1, description="longest prompt + output; default: the model's")
    enable_chunked_prefill: bool = True
    policy: Literal["fcfs", "priority"] = "fcfs"
    preemption_mode: Literal["recompute", "swap"] | None = Field(
        None, description="default: swap when swap_space > 0, else recompute"
    )
    disable_hybrid_kv_cache_manager: bool = Field(
        False, description="one block table for every layer: sliding-window layers keep all their blocks (vLLM's flag)"
    )


class ParallelConfig(_Config):
    tensor_parallel_size: int = Field(1, ge=1, description="ranks that split every layer's heads and MLP columns")
    pipeline_parallel_size: int = Field(1, ge=1, description="stages that split the decoder layers")
    distributed_executor_backend: Literal["mp", "ray"] | None = Field(
        None, description="mp: worker processes on this machine; ray: Ray actors; None: mp, or join torchrun's ranks"
    )
    distributed_timeout_seconds: float = Field(300.0, gt=0, description="seconds a collective may wait for a rank")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


class EngineConfig(_Config):
    model: str | None = Field(
        None, description="local directory, hub id or .gguf file; None = the default model (SmolLM2-135M-Instruct)"
    )
    tokenizer: str | None = None
    tokenizer_mode: str = Field(
        "auto", description="vLLM's flag: auto | hf (both: the model's Hugging Face tokenizer); slow, mistral and "
        "custom are refused, naming why",
    )  # fmt: skip
    trust_remote_code: bool = Field(
        False, description="run the Python code a model's repository ships (its auto_map classes) when loading its "
        "config, model and tokenizer (transformers' and vLLM's trust_remote_code)",
    )  # fmt: skip
    dtype: str = Field("auto", description="auto | float32 | float16 | bfloat16")
    quantization: str | None = Field(
        None,
        description="awq | gptq | fp8 | bitsandbytes | compressed-tensors | "
        "torchao (vLLM's names); None: as the checkpoint is saved",
    )
    quantization_param: str | None = Field(None, description="scheme of the method, e.g. int8_weight_only")
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N")
    # Bigger than one device (accelerate places the weights; each layer's KV sits on its execution device).
    device_map: str | dict | None = Field(None, description="auto | balanced | sequential | {module: device}")
    max_memory: dict | None = Field(None, description="{device: size}, e.g. {0: '20GiB', 'cpu': '60GiB'}")
    cpu_offload_gb: float = Field(0.0, ge=0, description="GiB of weights moved off the device (GPU->CPU, CPU->disk)")
    offload_folder: str | None = Field(None, description="where disk-offloaded weights go (non-safetensors)")
    seed: int = Field(0, ge=-(2**63), lt=2**64, description="the engine's random state (torch takes 64 bits)")
    attention_backend: Literal["auto", "torch", "cpu", "triton", "cuda"] = "auto"
    enforce_eager: bool = Field(
        False,
        description="vLLM's flag: no CUDA graphs (this engine captures them only with max_cudagraph_capture_size) and "
        "no compiled step (torch.compile measured 1.05x on CPU and was not kept)",
    )
    max_cudagraph_capture_size: int = Field(
        0,
        ge=0,
        description="GPU: decode steps of up to this many sequences replay captured CUDA graphs (vLLM's name); 0, "
        "the default until graphs are timed on a GPU: every step runs eagerly",
    )
    prepack_weights: bool = Field(
        True,
        description="CPU: run linear layers on oneDNN-prepacked weights (a model object passed in keeps its own "
        "weights, so its packed copies take as much memory again; a loaded model's are replaced)",
    )
    batch_invariant: bool = Field(
        default_factory=lambda: env_flag(BATCH_INVARIANT_ENV, False),
        description="a request's tokens and logprobs are bitwise the same alone or in any batch, chunking, "
        "prefix-cache state or preemption (fixed-tile linear layers, one attention path per row; slower); default: "
        f"{BATCH_INVARIANT_ENV}=1",
    )
    enable_lora: bool = False
    max_loras: int = Field(1, ge=1, description="most LoRA adapters in one step (device slots, evicted LRU)")
    max_lora_rank: int = Field(16, ge=1, description="largest LoRA rank accepted")
    lora_modules: dict[str, str] = Field(default_factory=dict, description="adapter name -> peft directory")
    cache: CacheConfig = Field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    speculative_config: SpeculativeConfig | None = Field(
        None, description='vLLM\'s: {"method": "ngram", "num_speculative_tokens": k} or {"model": PATH, ...}'
    )
    generation_config: str = Field(
        "auto", min_length=1, description="sampling defaults for the fields a request leaves out (vLLM's flag): "
        "auto, from the model's generation_config.json; vllm, none; or a folder holding a generation_config.json",
    )  # fmt: skip
    override_generation_config: dict | None = Field(
        None, description='sampling defaults over generation_config\'s (vLLM\'s flag), e.g. {"temperature": 0.5}'
    )

    @field_validator("tokenizer_mode")
    @classmethod
    def _check_tokenizer_mode(cls, mode: str) -> str:
        return check_tokenizer_mode(mode)

    @field_validator("override_generation_config", mode="before")
    @classmethod
    def _parse_override_generation_config(cls, value):
        return parse_override(value)

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _parse_speculative_config(cls, value):
        return parse_speculative_config(value)

    @field_validator("device_map", mode="before")
    @classmethod
    def _parse_device_map(cls, value):
        return parse_device_map(value)

    @field_validator("max_memory", mode="before")
    @classmethod
    def _parse_max_memory(cls, value):
        return parse_max_memory(value)
