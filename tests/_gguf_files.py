"""GGUF files for the GGUF-loading tests, written with the `gguf` package: a model in another tensor type, a
file of another architecture, one holding a tensor type that nothing here dequantizes, and a truncated file.
Each function writes a new file and returns its path."""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, LlamaFileType

FileTensor = tuple[np.ndarray, GGMLQuantizationType]  # the data as GGUFWriter takes it, and its GGUF type
UNSUPPORTED_TYPE = GGMLQuantizationType.Q8_K  # llama.cpp's dot-product intermediate: gguf cannot dequantize it


def read(path: Path | str) -> GGUFReader:
    """A file's reader, parsed once while the file is unchanged: parsing the real model's 100k tokenizer
    entries takes seconds, and the tests copy one source several times."""
    return _read(*_identity(path))


def dequantized(path: Path | str) -> dict[str, np.ndarray]:
    """A file's tensors as float32 (numpy order), by name; the last file's are kept (the real model's take
    seconds to compute and 540 MB to hold), so that its copies and their checks share them."""
    return _dequantized(*_identity(path))


def _identity(path: Path | str) -> tuple[Path, int, int]:
    stat = Path(path).stat()
    return Path(path).resolve(), stat.st_size, stat.st_mtime_ns


@lru_cache(maxsize=2)
def _read(path: Path, size: int, mtime_ns: int) -> GGUFReader:
    return GGUFReader(path)


@lru_cache(maxsize=1)
def _dequantized(path: Path, size: int, mtime_ns: int) -> dict[str, np.ndarray]:
    return {t.name: gguf.dequantize(t.data, t.tensor_type) for t in _read(path, size, mtime_ns).tensors}


def requantize(src: Path | str, dst: Path | str, qtype: GGMLQuantizationType) -> Path:
    """`src` with every tensor dequantized and stored again as `qtype`, its metadata copied field by field
    (`general.file_type` set to match)."""
    if qtype is GGMLQuantizationType.F32:
        file_type = LlamaFileType.ALL_F32
    else:
        file_type = LlamaFileType[f"MOSTLY_{qtype.name}"]  # a KeyError names a type with no llama file type
    reader, values = read(src), dequantized(src)
    return _rewrite(reader, dst, _architecture(reader), lambda tensor: _converted(values[tensor.name], qtype),
                    {gguf.Keys.General.FILE_TYPE: (int(file_type), GGUFValueType.UINT32)})  # fmt: skip


def with_architecture(src_or_none: Path | str | None, dst: Path | str, architecture: str) -> Path:
    """`src` (or, for None, `tiny_file`) relabelled as `architecture`, its `<arch>.*` keys renamed to match."""
    if src_or_none is None:
        return tiny_file(dst, architecture)
    reader = read(src_or_none)
    return _rewrite(reader, dst, architecture, lambda tensor: (tensor.data, tensor.tensor_type))


def with_unsupported_tensor(dst: Path | str) -> Path:
    """`tiny_file` with its ffn_gate tensor stored as Q8_K (random bytes of the right size)."""
    return tiny_file(dst, "llama", types={"blk.0.ffn_gate.weight": UNSUPPORTED_TYPE})


def truncated(src: Path | str, dst: Path | str, keep_fraction: float = 0.5) -> Path:
    """The first `keep_fraction` of `src`'s bytes, as an interrupted download leaves a file."""
    data = Path(src).read_bytes()
    Path(dst).write_bytes(data[: int(len(data) * keep_fraction)])
    return Path(dst)


def tiny_file(dst: Path | str, architecture: str = "llama",
              types: dict[str, GGMLQuantizationType] | None = None, feed_forward: int = 264) -> Path:  # fmt: skip
    """A complete one-block model of llama's layout (an 8-token vocabulary, 4 heads) that transformers loads
    in milliseconds: random F32 values, or random bytes of the right size for a tensor `types` stores as
    another type."""
    vocab, h, f = 8, 256, feed_forward  # hidden and feed-forward sizes; 264 is no multiple of 32: requantize keeps
    # ffn_down (rows of 264) in F32
    writer = gguf.GGUFWriter(str(dst), architecture)
    writer.add_name(f"tiny {architecture} (paged-backend test file)")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(h)
    writer.add_feed_forward_length(f)
    writer.add_head_count(4)
    writer.add_head_count_kv(4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["<s>", "</s>", "a", "b", "ab", "c", "d", "e"])
    writer.add_token_types([gguf.TokenType.CONTROL] * 2 + [gguf.TokenType.NORMAL] * (vocab - 2))
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    layer = {"attn_norm": (h,), "attn_q": (h, h), "attn_k": (h, h), "attn_v": (h, h), "attn_output": (h, h),
             "ffn_norm": (h,), "ffn_gate": (f, h), "ffn_up": (f, h), "ffn_down": (h, f)}  # fmt: skip
    shapes = {"token_embd.weight": (vocab, h), "output_norm.weight": (h,)} | {  # numpy order: (rows, row length)
        f"blk.0.{name}.weight": shape for name, shape in layer.items()
    }
    rng = np.random.default_rng(0)
    for name, shape in shapes.items():
        qtype = (types or {}).get(name, GGMLQuantizationType.F32)
        if qtype is GGMLQuantizationType.F32:
            writer.add_tensor(name, rng.standard_normal(shape, dtype=np.float32), raw_dtype=qtype)
        else:
            byte_shape = gguf.quant_shape_to_byte_shape(shape, qtype)
            writer.add_tensor(name, _random_blocks(rng, byte_shape, qtype), raw_dtype=qtype)
    return _finish(writer, dst)


# Where each block keeps its float16 scales (d, and a minimum's or K-quants' dmin), as byte offsets in the block.
SCALE_FIELDS = {
    GGMLQuantizationType.Q4_0: (0,), GGMLQuantizationType.Q4_1: (0, 2), GGMLQuantizationType.Q8_0: (0,),
    GGMLQuantizationType.Q5_0: (0,), GGMLQuantizationType.Q5_1: (0, 2), GGMLQuantizationType.Q2_K: (80, 82),
    GGMLQuantizationType.Q3_K: (108,), GGMLQuantizationType.Q4_K: (0, 2), GGMLQuantizationType.Q5_K: (0, 2),
    GGMLQuantizationType.Q6_K: (208,), GGMLQuantizationType.IQ4_NL: (0,), GGMLQuantizationType.IQ4_XS: (0,),
}  # fmt: skip


def _random_blocks(rng: np.random.Generator, byte_shape: tuple, qtype: GGMLQuantizationType) -> np.ndarray:
    """Random bytes of `qtype` blocks; where SCALE_FIELDS knows the type, its scales are small finite float16s (random
    bits there could be NaN or infinite), so the tensor dequantizes to finite weights a model can run."""
    data = rng.integers(0, 256, byte_shape, dtype=np.uint8)
    _, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = data.reshape(-1, block_bytes)
    for offset in SCALE_FIELDS.get(qtype, ()):
        scales = (rng.random(blocks.shape[0]) * 2e-3 + 1e-4).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return data


def _architecture(reader: GGUFReader) -> str:
    return reader.fields[gguf.Keys.General.ARCHITECTURE].contents()


def _converted(values: np.ndarray, qtype: GGMLQuantizationType) -> FileTensor:
    """A tensor's values as `qtype`, or as F32 where llama.cpp's quantizer keeps them: 1-D tensors (norms) and
    rows (numpy's last axis, GGUF's first) that are not a whole number of `qtype` blocks."""
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    if values.ndim == 1 or values.shape[-1] % block:
        qtype = GGMLQuantizationType.F32
    return gguf.quantize(values, qtype), qtype


def _rewrite(reader: GGUFReader, dst: Path | str, architecture: str, tensor_of: Callable[[gguf.ReaderTensor], FileTensor],
             overrides: dict[str, tuple[object, GGUFValueType]] | None = None) -> Path:  # fmt: skip
    """Write `reader`'s fields (each with its exact type, unless `overrides` gives one) and `tensor_of(tensor)`
    for each of its tensors to `dst`, as an `architecture` file."""
    old_prefix, overrides = f"{_architecture(reader)}.", overrides or {}
    writer = gguf.GGUFWriter(str(dst), architecture)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == gguf.Keys.General.ARCHITECTURE:
            continue  # the header's version and counts, and the architecture: the writer writes its own
        if key.startswith(old_prefix):
            key = f"{architecture}.{key[len(old_prefix) :]}"
        if key in overrides:
            value, value_type = overrides[key]
            writer.add_key_value(key, value, value_type)
        elif key == gguf.Keys.General.ALIGNMENT:
            writer.add_custom_alignment(field.contents())  # the writer pads tensor data by its own setting
        else:
            value_type, *item_types = field.types  # an array's element type follows ARRAY
            writer.add_key_value(key, field.contents(), value_type, item_types[0] if item_types else None)
    for tensor in reader.tensors:
        data, qtype = tensor_of(tensor)
        writer.add_tensor(tensor.name, data, raw_dtype=qtype)
    return _finish(writer, dst)


def _finish(writer: gguf.GGUFWriter, dst: Path | str) -> Path:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(dst)
