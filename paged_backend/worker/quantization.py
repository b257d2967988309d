"""Quantized weights: vLLM's `--quantization` and TGI's `--quantize` names, mapped onto transformers' quantizers.

A checkpoint whose config.json carries `quantization_config` loads as saved, with no flag. A flag on a
full-precision checkpoint quantizes it while loading (torchao; bitsandbytes, fp8 and eetq on a GPU); a flag
naming a pre-quantized format (awq, gptq, ...) must match the checkpoint's own `quant_method`. AWQ (GEMM) and
GPTQ int4 checkpoints load on CPU without a kernel package (`int4_checkpoint`: repacked for torchao's CPU int4
kernel, or dequantized). Formats whose kernels need a GPU (Marlin, exl2, bitsandbytes, ...) are refused on CPU
before any weight is read, with a sentence naming what they need.

`quantization_param` picks the scheme inside a method (torchao: int8_weight_only, int4_weight_only,
int8_dynamic_activation_int8_weight; bitsandbytes: 8bit, nf4, fp4). vLLM passes torchao schemes as a JSON
config file; one word on the command line says the same for the schemes that run here.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from paged_backend.errors import InvalidRequest, UnsupportedModel
from paged_backend.worker import int4_formats

TORCHAO_SCHEMES = ("int8_weight_only", "int4_weight_only", "int8_dynamic_activation_int8_weight")
BITSANDBYTES_SCHEMES = ("8bit", "nf4", "fp4")
INT4_GROUP_SIZE = 32


@dataclass(frozen=True)
class Method:
    """One weight format: where its kernels run and how a checkpoint saved in it names itself."""

    name: str
    checkpoint_methods: tuple[str, ...]  # `quant_method` values in config.json this format loads
    on_the_fly: bool  # can quantize a full-precision checkpoint while loading
    runs_on_cpu: bool
    needs: str  # what it needs, said when it is refused
    package: str | None = None  # the Python package whose kernels it calls
    schemes: tuple[str, ...] = ()
    default_scheme: str | None = None
    int4_on_cpu: bool = False  # on CPU its checkpoints load through int4_checkpoint, without `package`


METHODS = {
    m.name: m
    for m in (
        Method("torchao", ("torchao",), True, True, "the torchao package", "torchao", TORCHAO_SCHEMES,
               "int8_weight_only"),
        Method("bitsandbytes", ("bitsandbytes",), True, False, "a CUDA GPU and the bitsandbytes package",
               "bitsandbytes", BITSANDBYTES_SCHEMES, "nf4"),
        Method("fp8", ("fp8", "fbgemm_fp8"), True, False, "a CUDA GPU with fp8 support (compute capability 8.9+)"),
        Method("eetq", ("eetq",), True, False, "a CUDA GPU and the eetq package", "eetq"),
        Method("awq", ("awq",), False, True, "an AWQ kernel package (gptqmodel) on a CUDA GPU", "gptqmodel",
               int4_on_cpu=True),
        Method("gptq", ("gptq",), False, True, "a GPTQ kernel package (gptqmodel) on a CUDA GPU", "gptqmodel",
               int4_on_cpu=True),
        Method("marlin", ("gptq", "awq"), False, False, "a CUDA GPU (compute capability 8.0+) for Marlin kernels",
               "gptqmodel"),
        Method("compressed-tensors", ("compressed-tensors",), False, False,
               "a CUDA GPU and the compressed-tensors package", "compressed_tensors"),
        Method("exl2", ("exl2",), False, False, "ExLlamaV2, which transformers has no quantizer for; "
               "use a GPTQ or AWQ export of the model"),
    )
}  # fmt: skip
# TGI's `--quantize` values that are a scheme of one method rather than a method of their own.
TGI_ALIASES = {"bitsandbytes": ("bitsandbytes", "8bit"), "bitsandbytes-nf4": ("bitsandbytes", "nf4"),
               "bitsandbytes-fp4": ("bitsandbytes", "fp4")}  # fmt: skip
# TGI's names, plus torchao (a paged-backend addition: int8 weight-only, the scheme that runs on CPU).
TGI_NAMES = ("awq", "gptq", "bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4", "fp8", "eetq", "marlin", "exl2",
             "torchao")  # fmt: skip


def from_tgi(quantize: str | None) -> tuple[str | None, str | None]:
    """TGI's `--quantize NAME` -> (quantization, quantization_param).

    >>> from_tgi("bitsandbytes-nf4")
    ('bitsandbytes', 'nf4')
    """
    if quantize is None:
        return None, None
    if quantize not in TGI_NAMES:
        raise InvalidRequest(f"unknown --quantize {quantize!r}; choose one of {', '.join(TGI_NAMES)}")
    return TGI_ALIASES.get(quantize, (quantize, None))


def checkpoint_method(config) -> str | None:
    """The `quant_method` a checkpoint's config declares, or None for full precision."""
    saved = getattr(config, "quantization_config", None)
    if saved is None:
        return None
    method = saved.get("quant_method") if isinstance(saved, dict) else getattr(saved, "quant_method", None)
    return str(getattr(method, "value", method)).replace("_", "-") if method is not None else None


def _check_runs_here(method: Method, device: torch.device, source: str) -> None:
    if not method.runs_on_cpu and device.type != "cuda":
        raise UnsupportedModel(
            f"{source} {method.name!r} needs {method.needs}; this engine runs on "
            f"{device.type}. On CPU use --quantization torchao (int8_weight_only, int4_weight_only)"
        )
    if method.name == "exl2":
        raise UnsupportedModel(f"{source} 'exl2' needs {method.needs}")
    without_package = method.int4_on_cpu and device.type == "cpu"
    if method.package and not without_package and importlib.util.find_spec(method.package) is None:
        raise UnsupportedModel(f"{source} {method.name!r} needs {method.needs}: pip install {method.package}")


def _find_method_for_checkpoint(saved: str) -> Method | None:
    return next((m for m in METHODS.values() if saved.replace("-", "_") in
                 [c.replace("-", "_") for c in m.checkpoint_methods]), None)  # fmt: skip


def _saved_format(config, saved: str) -> Method | None:
    """The format a checkpoint is saved in: its `quant_method`, or Marlin when an AWQ/GPTQ config says its
    weights are repacked for that GPU kernel."""
    method = _find_method_for_checkpoint(saved)
    if method is not None and method.int4_on_cpu and int4_formats.is_marlin_format(int4_formats.saved_settings(config)):
        return METHODS["marlin"]
    return method


def _saved_as_is(method: Method | None, config, device: torch.device) -> int4_formats.Int4Scheme | None:
    """What loads a checkpoint saved quantized: its int4 scheme when CPU loads it through `int4_checkpoint`
    (checked here, before any weight is read), else None (transformers' own quantizer)."""
    if method is not None and method.int4_on_cpu and device.type == "cpu":
        return int4_formats.Int4Scheme.from_config(int4_formats.saved_settings(config))
    return None


def resolve(quantization: str | None, param: str | None, config, device: torch.device):
    """What loads the model: the `quantization_config` to hand `from_pretrained`; an `Int4Scheme` when the checkpoint
    is an AWQ/GPTQ int4 export to load on CPU with `int4_checkpoint.load_int4_checkpoint`; or None to load it as saved.

    Raises `InvalidRequest` for unknown names or a flag that contradicts the checkpoint, and
    `UnsupportedModel` when the format's kernels cannot run on `device`.
    """
    saved = checkpoint_method(config) if config is not None else None
    if quantization is None:
        if param is not None:
            raise InvalidRequest("quantization_param was given without quantization; add --quantization NAME")
        method = _saved_format(config, saved) if saved else None
        if method is not None:
            _check_runs_here(method, device, "the checkpoint is quantized with")
        # None: full precision, or a format transformers itself loads (or refuses with its own words)
        return _saved_as_is(method, config, device)
    if quantization not in METHODS:
        raise InvalidRequest(f"unknown quantization {quantization!r}; choose one of {', '.join(METHODS)}")
    method = METHODS[quantization]
    if saved is not None:
        if saved.replace("-", "_") not in [c.replace("-", "_") for c in method.checkpoint_methods]:
            raise InvalidRequest(
                f"the checkpoint is quantized with {saved!r} but quantization={quantization!r} "
                f"was given; drop the flag or pass --quantization {saved}"
            )
        saved_format = _saved_format(config, saved) if method.int4_on_cpu else method  # awq/gptq: Marlin-packed?
        _check_runs_here(saved_format, device, "the checkpoint is quantized with")
        if param is not None:
            raise InvalidRequest(
                "quantization_param applies to on-the-fly quantization; this checkpoint is "
                "already quantized, drop --quantization-param"
            )
        return _saved_as_is(saved_format, config, device)
    _check_runs_here(method, device, "quantization")
    if not method.on_the_fly:
        raise InvalidRequest(
            f"quantization {quantization!r} needs a checkpoint already quantized with it (its "
            f"config.json carries quantization_config); to quantize a full-precision model while "
            f"loading use torchao, bitsandbytes, fp8 or eetq"
        )
    scheme = param or method.default_scheme
    if method.schemes and scheme not in method.schemes:
        raise InvalidRequest(
            f"quantization_param {scheme!r} is not a {quantization} scheme; choose one of {', '.join(method.schemes)}"
        )
    if not method.schemes and param is not None:
        raise InvalidRequest(f"quantization {quantization!r} takes no quantization_param; drop it")
    return _transformers_config(method.name, scheme, device)


def _transformers_config(name: str, scheme: str | None, device: torch.device):
    import transformers

    if name == "torchao":
        return transformers.TorchAoConfig(torchao_config(scheme, device))
    if name == "bitsandbytes":
        if scheme == "8bit":
            return transformers.BitsAndBytesConfig(load_in_8bit=True)
        return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=scheme)
    if name == "fp8":
        return transformers.FineGrainedFP8Config()
    return transformers.EetqConfig()


def torchao_config(scheme: str, device: torch.device):
    """torchao's config object for a scheme name. int4 on CPU: torchao's packed int4 kernels are CUDA-only
    (tinygemm, mslk), so CPU gets the intx workflow (int4 values with per-group scales, dequantized per matmul)."""
    from torchao.quantization import (
        Int4WeightOnlyConfig,
        Int8DynamicActivationInt8WeightConfig,
        Int8WeightOnlyConfig,
        IntxWeightOnlyConfig,
    )
    from torchao.quantization.granularity import PerGroup

    if scheme == "int8_weight_only":
        return Int8WeightOnlyConfig()
    if scheme == "int8_dynamic_activation_int8_weight":
        return Int8DynamicActivationInt8WeightConfig()
    if device.type == "cuda":
        return Int4WeightOnlyConfig(group_size=INT4_GROUP_SIZE, int4_packing_format="tile_packed_to_4d")
    return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(INT4_GROUP_SIZE))


def quantize_in_place(model: torch.nn.Module, quantization: str | None, param: str | None) -> None:
    """Quantize a model built in memory (the embedded default); only torchao works on a live module."""
    if quantization is None:
        return
    config = resolve(quantization, param, None, next(model.parameters()).device)
    if quantization != "torchao":
        raise InvalidRequest(
            f"quantization {quantization!r} needs a checkpoint directory (--model); the "
            f"embedded model can be quantized with torchao only"
        )
    from torchao.quantization import quantize_

    # As transformers' TorchAoConfig does by default: the linear layers, not the output embeddings.
    output_embeddings = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    quantize_(
        model,
        config.get_apply_tensor_subclass(),
        filter_fn=lambda module, _: isinstance(module, torch.nn.Linear) and module is not output_embeddings,
    )


def _tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor holds; a torchao subclass counts its inner data and scales."""
    if hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer, counting quantized tensors at their packed size."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}  # tied weights count once
    return sum(_tensor_bytes(t.data if isinstance(t, torch.nn.Parameter) else t) for t in tensors.values())
