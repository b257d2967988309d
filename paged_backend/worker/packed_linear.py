"""CPU linear layers on weights packed once into a layout made for the step's shapes ("prepacked").

A decode step multiplies a few rows by every weight matrix: a stream over the weights. MKL's sgemm (`F.linear`)
runs those small shapes at a fraction of the core's peak. The packed forward runs them on the panel kernel
(`ops/panel_linear.py`: weights in 16-column panels, streamed at the memory bandwidth, ~1.6x oneDNN's prepacked
sgemm at one row and on par with it at prefill sizes), or, where the csrc/cpu library cannot be built, on
oneDNN's reordered weight (vLLM's CPU backend packs with oneDNN). `benchmarks/packed_linear.py` measures all three.

The runner swaps each packed layer's `forward` in for its own forwards only (`PackedLinears.active`), as it switches
attention: a caller's model object is the same between steps. A model the engine loaded itself gives up its dense
weights once packed (`release=True`): the packed copy replaces them, so packing costs no memory there; an input
embedding tied to the LM head then reads its rows from the head's panels, so the tied matrix is held once. A caller's
object keeps its weights, and the packed copies take as much memory again (`EngineConfig.prepack_weights=False`
turns packing off). Layers that read the same input (q, k and v) can be stacked into one call (`stacked`).

Quantized weights pack too, into int8 or int4 panels (a byte or half a byte per weight, dequantized in registers as
the format's own dequantization computes), so they run the fused forward and its C++ layer loop:
- torchao's int8 and int4 weight-only layers (`--quantization torchao`, int8_weight_only / int4_weight_only), whose
  CPU path dequantizes the whole matrix per call;
- the linear layers of a model loaded from a GGUF file, from the Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, K-quant and IQ4 blocks they
  were dequantized from (`gguf_blocks`): the same values from a sixth to a quarter of the float32 bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache

import torch
from torch import nn

from paged_backend.ops.cpu import unavailable_reason
from paged_backend.ops.panel_linear import PANEL_DTYPES, PanelWeight, QuantizedWeight
from paged_backend.worker import gguf_blocks

PACKED_DTYPES = (torch.float32, torch.bfloat16)


@cache
def panels_build() -> bool:
    """Whether the panel kernel is here (the csrc/cpu library builds on this machine)."""
    return unavailable_reason() is None


@cache  # a property of this torch build and this CPU
def dtype_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN's ops are present and pack `dtype` on this CPU: bfloat16 needs AVX512-BF16-class features
    (avx_ne_convert, or avx512bw/vl/dq), which many CI and cloud CPUs lack; those run bfloat16 layers dense."""
    ops = torch.ops.mkldnn
    if dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    if not all(hasattr(ops, name) for name in ("_reorder_linear_weight", "_linear_pointwise")):
        return False
    try:
        ops._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype))
    except RuntimeError:
        return False
    return True


def packable(module: nn.Module) -> bool:
    """A plain CPU `nn.Linear` in float32 or bfloat16 whose forward nobody else replaced (accelerate's offload
    hooks do, and quantized weights are tensor subclasses with kernels of their own), in a dtype this CPU packs;
    or one whose weight is quantized in a way the quantized panels take (`quantized_weight`)."""
    if not isinstance(module, nn.Linear) or type(module).forward is not nn.Linear.forward:
        return False  # a subclass with a forward of its own (bitsandbytes' layers)
    if "forward" in module.__dict__:
        return False
    weight = module.weight
    if weight.device.type != "cpu" or weight.dim() != 2:
        return False
    if quantized_weight(weight) is not None and quantized_panels_run(weight.device, weight.dtype):
        return True
    return type(weight.data) is torch.Tensor and packs(weight.dtype)  # (a GGUF-loaded one as plain float weights)


def quantized_panels_run(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether quantized panels serve layers on `device` in `dtype` (the CPU panel kernel builds and takes that dtype):
    where they do not, a quantized weight keeps its own forward and GGUF blocks are not worth reading."""
    return device.type == "cpu" and dtype in PANEL_DTYPES and panels_build()


def quantized_weight(weight: torch.Tensor) -> QuantizedWeight | None:
    """The quantized form of `weight` the quantized panels run, else None: torchao's weight-only tensor, or the GGUF
    blocks a loaded model's float weight was dequantized from (while it is unchanged)."""
    return torchao_weight_only(weight) or gguf_blocks.source_of(weight)


def torchao_weight_only(weight: torch.Tensor) -> QuantizedWeight | None:
    """torchao's weight-only tensors that the panels take, else None:
    - int8_weight_only (`Int8Tensor`): bits 8, a float32 scale per output, group size 0;
    - int4_weight_only on CPU (`IntxUnpackedToInt8Tensor`, the intx workflow): values -8 to 7 and a scale per output
      and group of K; the panels take them as q + 8 with an offset of -8 * scale.
    Both symmetric, without activation quantization, so `dequantize()` is q * scale in the weight's dtype, which the
    quantized panels compute exactly ((q + 8) * scale - 8 * scale has one rounding, and -8 * scale is exact)."""
    data = weight.data
    kind = type(data).__name__
    if kind not in ("Int8Tensor", "IntxUnpackedToInt8Tensor") or not type(data).__module__.startswith("torchao"):
        return None
    activation_side = ("act_quant_kwargs", "act_pre_scale", "activation_quantization")  # dynamic or AWQ pre-scaled
    if any(getattr(data, name, None) is not None for name in activation_side):
        return None
    zero_point = getattr(data, "zero_point", None)
    if zero_point is not None and bool(zero_point.any()):
        return None  # asymmetric (torchao keeps zeros for the symmetric schemes)
    q, scale, block = data.qdata, data.scale, tuple(data.block_size)
    if q.dtype != torch.int8 or q.dim() != 2 or len(block) != 2 or block[0] != 1:
        return None
    rows, columns = q.shape
    if kind == "Int8Tensor":
        return QuantizedWeight(8, q, scale, 0) if block[1] == columns and scale.numel() == rows else None
    group = block[1]
    if getattr(data, "target_dtype", None) != torch.int4 or group < 2 or group % 2 or columns % group:
        return None
    if tuple(scale.shape) != (rows, columns // group):
        return None
    return QuantizedWeight(4, (q + 8).to(torch.uint8), scale, group, scale.float() * -8)


def packs(dtype: torch.dtype) -> bool:
    """Whether layers of `dtype` pack here: float32 and bfloat16 wherever the panel kernel builds; without it,
    what oneDNN packs (bfloat16 only on AVX512-BF16-class CPUs)."""
    return dtype in PANEL_DTYPES if panels_build() else dtype_packs(dtype)


@torch.no_grad()
def packed_forward(module: nn.Linear):
    """A forward for `module` on a packed copy of its current weight (and its bias as it is): panels, or oneDNN's
    reordered weight where the panel kernel cannot be built. A panel forward carries its `PanelWeight` as `panel` and
    its bias as `bias`."""
    bias = module.bias
    if panels_build():
        quantized = quantized_weight(module.weight)
        panel = PanelWeight(module.weight.detach()) if quantized is None else quantized.panels(module.weight.dtype)

        def panel_forward(x: torch.Tensor) -> torch.Tensor:
            return panel(x, bias)

        panel_forward.panel, panel_forward.bias = panel, bias
        return panel_forward
    packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach())

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    return forward


def _stamp(module: nn.Module) -> tuple:
    """What a packed copy was made from: the module's parameter dict, the weight and bias objects in it, and their
    in-place version counters (`_unchanged` checks every watched layer at every step, so it touches no more)."""
    params = module._parameters
    weight, bias = params["weight"], params["bias"]
    return params, weight, bias, _versions(weight, bias)


def _versions(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    return weight._version, None if bias is None else bias._version


def _unchanged(stamp: tuple) -> bool:
    params, weight, bias, versions = stamp
    return params["weight"] is weight and params["bias"] is bias and _versions(weight, bias) == versions


class PackedLinears:
    """The packed weights of a model's linear layers, and the forwards that use them.

    A layer whose weight or bias was replaced or changed in place since it was packed (an optimizer step,
    `load_state_dict`, a write under `torch.no_grad()`) is packed again before the next forward; writes through
    `.data` bypass the version counters that tell, as they bypass autograd. Layers that gave their dense weights up
    (`release`) have nothing left to change and are not watched: the check costs ~0.2 ms a step in a 30-layer model,
    its tensors cold in cache."""

    def __init__(self, model: nn.Module, release: bool = False) -> None:
        self.layers: dict[nn.Module, tuple] = {}  # module -> (packed forward, stamp of what it was packed from)
        self._stacks: dict[tuple, tuple] = {}  # modules -> (their packed forwards when stacked, stacked forward)
        self.generation = 0  # changes whenever a layer is packed again or dropped (what callers' caches key on)
        self._watched: list[nn.Module] = []  # the layers that kept their dense weights
        shared = _shared_weights(model)
        for module in model.modules():
            if not packable(module) or module in self.layers:
                continue
            forward = packed_forward(module)
            if release and id(module.weight) not in shared:  # a tied LM head: see _embedding_from_panels
                module.weight = _released(module.weight)
            else:
                self._watched.append(module)
            self.layers[module] = forward, _stamp(module)
        if release:
            self._embedding_from_panels(model)

    def _embedding_from_panels(self, model: nn.Module) -> None:
        """A plain input embedding tied to a packed LM head reads its rows from the head's panels
        (`PanelWeight.rows`) and both give the shared weight up, so the matrix is held once: SmolLM2's 49152 x 576
        embedding kept 113 MB of float32 beside its head's 28 MB of Q8_0 panels. Only where the rows equal the
        weight bit for bit (checked once here): the embeddings, and so every token, stay what they were."""
        get = getattr(model, "get_input_embeddings", None)
        embedding = get() if get is not None else None
        if type(embedding) is not nn.Embedding or embedding.max_norm is not None:
            return  # (a subclass's forward does more than the lookup: Gemma's scales it)
        weight = embedding.weight
        heads = [module for module in self._watched if module.weight is weight]
        panel = getattr(self.layers[heads[0]][0], "panel", None) if heads else None
        if panel is None or weight.device.type != "cpu" or type(weight.data) is not torch.Tensor:
            return
        if (panel.out_features, panel.in_features) != tuple(weight.shape):  # a head sharded across ranks
            return
        with torch.no_grad():
            if not torch.equal(panel.rows(torch.arange(weight.shape[0])), weight):
                return

        def embedding_forward(ids: torch.Tensor) -> torch.Tensor:
            return panel.rows(ids)

        embedding_forward.panel = panel  # (the fused forward tells the packer's forwards from a caller's by it)
        embedding.forward = embedding_forward
        released = _released(weight)
        embedding.weight = released
        for head in heads:
            head.weight = released
            self._watched.remove(head)
            self.layers[head] = self.layers[head][0], _stamp(head)  # (the old stamp held the weight)

    def __len__(self) -> int:
        return len(self.layers)

    def refresh(self) -> int:
        """Pack again every watched layer that changed since it was packed; the generation after."""
        changed = [module for module in self._watched if not _unchanged(self.layers[module][1])]
        for module in changed:
            self.generation += 1
            if packable(module):
                self.layers[module] = packed_forward(module), _stamp(module)
            else:  # quantized or hooked since: its own forward runs
                del self.layers[module]
                self._watched.remove(module)
        return self.generation

    def forwards(self) -> dict[nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
        """Each packed layer's packed forward, repacked first where the layer changed: for a caller that calls them
        itself (the fused forward) instead of swapping them in with `active()`. Hooks are the caller's to run."""
        self.refresh()
        return {module: forward for module, (forward, _) in self.layers.items()}

    def stacked(self, modules: tuple[nn.Module, ...]) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """One forward for layers that read the same input (a layer's q, k and v; gate and up): their outputs side
        by side from one call over their stacked panels (`PanelWeight.stack`, no extra memory), biases included.
        None when they are not all panel-packed or cannot stack. Valid until one of them is packed again, after which
        the next call stacks anew; call it after `forwards()`, which repacks what changed."""
        forwards = tuple(self.layers[module][0] if module in self.layers else None for module in modules)
        if any(getattr(forward, "panel", None) is None for forward in forwards):
            return None
        cached = self._stacks.get(modules)
        if cached is not None and cached[0] == forwards:
            return cached[1]
        group = PanelWeight.stack([forward.panel for forward in forwards])
        if group is None:
            self._stacks[modules] = forwards, None
            return None
        biases = [module.bias for module in modules]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b.detach() if b is not None else torch.zeros(m.out_features, dtype=group.dtype)
                              for b, m in zip(biases, modules, strict=True)])  # fmt: skip

        def stacked_forward(x: torch.Tensor) -> torch.Tensor:
            return group(x, bias)

        stacked_forward.panel, stacked_forward.bias = group, bias
        self._stacks[modules] = forwards, stacked_forward
        return stacked_forward

    @contextmanager
    def active(self) -> Iterator[None]:
        """Packed forwards on every packed layer for the duration (forward hooks, e.g. LoRA's, still run)."""
        self.refresh()
        for module, (forward, _) in self.layers.items():
            module.forward = forward
        try:
            yield
        finally:
            for module in self.layers:
                del module.forward


def _released(weight: torch.Tensor) -> nn.Parameter:
    """What a layer holds once its packed copy replaced its weight: an empty parameter of its dtype (a plain tensor,
    for a quantized weight too)."""
    return nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False)


def _shared_weights(model: nn.Module) -> set[int]:
    """ids of parameters reachable under more than one name (tied embeddings)."""
    seen: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        seen[id(param)] = seen.get(id(param), 0) + 1
    return {key for key, count in seen.items() if count > 1}


def pack_linears(model: nn.Module, enabled: bool, release: bool) -> PackedLinears | None:
    """The model's packed linear layers, or None when packing is off or nothing packs (GPU, quantized, offloaded).
    The GGUF blocks on its weights are freed here, packed or not: nothing else reads them."""
    packed = PackedLinears(model, release) if enabled else None
    for weight in model.parameters():
        gguf_blocks.drop(weight)
    return packed if packed is not None and len(packed) else None
