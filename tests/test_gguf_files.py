"""The GGUF test files are what they claim: copies of a model in another tensor type keep its
metadata and its values (within the type's rounding), and the foreign, unsupported and truncated files are
read by the `gguf` package as such."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="GGUF support needs the gguf package: pip install 'paged-backend[gguf]'")

from gguf import GGMLQuantizationType, GGUFReader, LlamaFileType  # noqa: E402

from tests._gguf_files import (  # noqa: E402
    UNSUPPORTED_TYPE,
    dequantized,
    read,
    requantize,
    tiny_file,
    truncated,
    with_architecture,
    with_unsupported_tensor,
)

F32, F16, Q8_0 = GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.Q8_0
FILE_TYPE = gguf.Keys.General.FILE_TYPE


def metadata(reader: GGUFReader) -> dict[str, tuple[list, object]]:
    """Every field as (its value types, its value)."""
    return {key: (field.types, field.contents()) for key, field in reader.fields.items()}


def assert_within_rounding(tensor: gguf.ReaderTensor, source: np.ndarray):
    """F32: the source bit for bit. F16: the source rounded to fp16. Q8_0: within one quantization step of the
    block (its largest magnitude / 127), which covers the rounding of the values and of the block's fp16 scale."""
    if tensor.tensor_type is F32:
        assert np.array_equal(tensor.data.view(np.uint32), source.view(np.uint32)), tensor.name
    elif tensor.tensor_type is F16:
        assert np.array_equal(tensor.data.view(np.uint16), source.astype(np.float16).view(np.uint16)), tensor.name
    else:
        block, _ = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
        blocks = source.reshape(-1, block)
        copy = gguf.dequantize(tensor.data, tensor.tensor_type).reshape(-1, block)
        assert np.all(np.abs(copy - blocks) <= np.abs(blocks).max(axis=1, keepdims=True) / 127), tensor.name


def assert_copy_of(copy: GGUFReader, source: GGUFReader, source_values: dict[str, np.ndarray],
                   qtype: GGMLQuantizationType):  # fmt: skip
    """`copy` is `requantize(source, qtype)`: same fields (bar file_type), same tensors, values within rounding."""
    expected_fields, fields = metadata(source), metadata(copy)
    assert fields.pop(FILE_TYPE)[1] != expected_fields.pop(FILE_TYPE)[1]
    assert fields == expected_fields
    assert [(t.name, t.shape.tolist()) for t in copy.tensors] == [(t.name, t.shape.tolist()) for t in source.tensors]
    for tensor in copy.tensors:
        source_tensor = source_values[tensor.name]
        kept_f32 = source_tensor.ndim == 1 or source_tensor.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] != 0
        assert tensor.tensor_type is (F32 if kept_f32 else qtype), tensor.name
        assert_within_rounding(tensor, source_tensor)


@pytest.mark.parametrize("qtype, file_type", [(Q8_0, LlamaFileType.MOSTLY_Q8_0), (F16, LlamaFileType.MOSTLY_F16)],
                         ids=["Q8_0", "F16"])  # fmt: skip
def test_a_copy_keeps_its_metadata_and_values(tmp_path, qtype, file_type):
    source = tiny_file(tmp_path / "tiny.gguf")  # the same code copies the real model (test_gguf_source.py)
    copy = GGUFReader(requantize(source, tmp_path / f"model.{qtype.name}.gguf", qtype))
    assert_copy_of(copy, read(source), dequantized(source), qtype)
    assert copy.fields[FILE_TYPE].contents() == file_type


def test_an_f32_copy_is_the_exact_dequantization_and_odd_rows_stay_f32(tmp_path):
    path = requantize(tiny_file(tmp_path / "tiny.gguf"), tmp_path / "tiny.Q8_0.gguf", Q8_0)
    source = GGUFReader(path)
    assert source.get_tensor(0).tensor_type is Q8_0
    assert source.tensors[-1].name == "blk.0.ffn_down.weight" and source.tensors[-1].tensor_type is F32
    copy = GGUFReader(requantize(path, tmp_path / "tiny.F32.gguf", F32))
    assert_copy_of(copy, source, dequantized(path), F32)
    assert copy.fields[FILE_TYPE].contents() == LlamaFileType.ALL_F32


def test_a_relabelled_file_names_the_new_architecture(tmp_path):
    tiny = GGUFReader(with_architecture(None, tmp_path / "mamba2.gguf", "mamba2"))
    assert tiny.fields["general.architecture"].contents() == "mamba2"
    assert tiny.fields["mamba2.block_count"].contents() == 1 and tiny.tensors
    source = GGUFReader(tiny_file(tmp_path / "llama.gguf"))
    relabelled = GGUFReader(with_architecture(tmp_path / "llama.gguf", tmp_path / "rwkv6.gguf", "rwkv6"))
    renamed = {key.replace("llama.", "rwkv6.", 1): value for key, value in metadata(source).items()}
    renamed["general.architecture"] = (renamed["general.architecture"][0], "rwkv6")
    assert metadata(relabelled) == renamed
    assert [t.data.tobytes() for t in relabelled.tensors] == [t.data.tobytes() for t in source.tensors]


def test_the_unsupported_tensor_is_stored_as_a_type_gguf_cannot_dequantize(tmp_path):
    reader = GGUFReader(with_unsupported_tensor(tmp_path / "q8k.gguf"))
    assert reader.fields["general.architecture"].contents() == "llama"
    [odd] = [t for t in reader.tensors if t.tensor_type is not F32]
    assert odd.tensor_type is UNSUPPORTED_TYPE and odd.n_bytes == odd.data.nbytes
    with pytest.raises(NotImplementedError):
        gguf.dequantize(odd.data, odd.tensor_type)


@pytest.mark.parametrize("keep_fraction", [0.5, 0.0005])  # a cut in the tensor data; one in the metadata
def test_a_truncated_file_cannot_be_read(tmp_path, keep_fraction):
    whole = tiny_file(tmp_path / "tiny.gguf")
    cut = truncated(whole, tmp_path / "cut.gguf", keep_fraction)
    assert cut.read_bytes() == whole.read_bytes()[: int(whole.stat().st_size * keep_fraction)]
    with pytest.raises((ValueError, IndexError)):  # what numpy raises on the short buffer
        GGUFReader(cut)
