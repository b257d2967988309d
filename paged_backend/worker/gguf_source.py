"""GGUF files as a model source: converted once through transformers' GGUF loader, then loaded as a plain
HF directory from the cache.

A `.gguf` file (or a directory holding exactly one) carries the architecture, the weights, the tokenizer and
the chat template. transformers reads all of it and dequantizes the tensors, which takes seconds: 17-18 s for
the 135M default model as Q8_0 on 2 cores (25.5 s with the garbage collector running: each parse of the header makes
~500,000 objects, and transformers parses the file three times, for config, tokenizer and weights). This module
parses it once more, for its checks and the blocks, and maps the tensor names once more. The result is saved once under
`cache_root()/gguf/<content hash>` as config + safetensors (float32: the exact dequantized values) +
tokenizer, plus the Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, K-quant and IQ4 blocks of its linear weights (`gguf_blocks`: the CPU
panels run on them), with a manifest of the entry's file checksums. The next start hashes the GGUF file, finds the
entry, checks the manifest, and loads a directory in well under a second. An entry whose files do not match their
manifest is deleted and rebuilt, never trusted.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from paged_backend.core.build_cache import build_once, cache_root
from paged_backend.errors import InvalidRequest, UnsupportedModel
from paged_backend.startup import collector_paused
from paged_backend.worker import gguf_blocks

if TYPE_CHECKING:
    from gguf import GGUFReader

MAGIC = b"GGUF"
MANIFEST = "manifest.json"
CACHE_FORMAT = 4  # bump when the layout of an entry changes


def gguf_file(model: str) -> Path | None:
    """The GGUF file `model` names (a `.gguf` file, or a directory holding exactly one), else None."""
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise InvalidRequest(f"model file '{model}' not found: no such .gguf file")
        return path
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise InvalidRequest(f"'{model}' holds several GGUF files ({names}); give --model the one to load")
    return found[0] if found else None


def converted(path: Path) -> Path:
    """The cached HF directory for GGUF file `path`, built on first use (or when its entry is damaged)."""
    entry = cache_entry(path)
    if entry.exists() and not _intact(entry):
        print(f"paged-backend: the cached conversion {entry} is damaged; rebuilding it", file=sys.stderr)
        shutil.rmtree(entry, ignore_errors=True)
    if entry.exists():
        return entry
    with collector_paused():  # a parse makes ~500,000 objects, and transformers parses the file three times more
        reader = check(path)
        print(f"paged-backend: converting {path.name} once (cached in {entry})", file=sys.stderr)
        for stale in entry.parent.glob(f"{entry.name.rsplit('-v', 1)[0]}-v*"):  # this file's older-format entries
            shutil.rmtree(stale, ignore_errors=True)
        return build_once(entry, lambda scratch: _convert(path, scratch, reader))


def cache_entry(path: Path) -> Path:
    """Where the conversion of `path` lives: keyed by the file's content, so a renamed copy hits it too."""
    return cache_root() / "gguf" / f"{_digest(path)}-v{CACHE_FORMAT}"


def check(path: Path) -> GGUFReader:
    """The file's reader; or a refusal, with a sentence, of a file that is not a complete GGUF or holds tensors no
    loader here reads. (Parsing the header takes seconds on a real model's tokenizer fields: read it once.)"""
    from gguf import GGUFReader

    with open(path, "rb") as handle:
        if handle.read(4) != MAGIC:
            raise InvalidRequest(f"{path} is not a GGUF file (it does not start with 'GGUF')")
    try:
        reader = GGUFReader(path)
    except Exception as exc:  # the reader raises whatever numpy does on a short file
        raise InvalidRequest(
            f"{path} is not a readable GGUF file; it is truncated or corrupt ({type(exc).__name__}: {exc}). "
            f"Download or copy it again"
        ) from exc
    unreadable = sorted(t.name for t in {t.tensor_type for t in reader.tensors} if not _dequantizes(t))
    if unreadable:
        raise UnsupportedModel(
            f"{path.name} stores tensors as {', '.join(unreadable)}, which transformers' GGUF loader cannot "
            f"dequantize; convert the model to a supported type (F32, F16, BF16, Q8_0, Q4_K, ...) with "
            f"llama-quantize"
        )
    return reader


def _dequantizes(qtype) -> bool:
    from gguf import GGML_QUANT_SIZES, dequantize

    _, block_bytes = GGML_QUANT_SIZES[qtype]
    try:
        dequantize(np.zeros(block_bytes, dtype=np.uint8), qtype)
    except (NotImplementedError, ValueError):
        return False
    return True


def _convert(path: Path, out: Path, reader: GGUFReader) -> None:
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(path.parent), path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model, loading = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, output_loading_info=True
        )
    except Exception as exc:  # the file is user input: whatever transformers trips on, say which file and why
        if isinstance(exc, ValueError) and "architecture" in str(exc):  # transformers names it
            raise UnsupportedModel(f"{path.name}: {exc} Use a GGUF of a supported architecture (llama, qwen2, "
                                   f"mistral, ...), or the model's safetensors checkpoint") from exc  # fmt: skip
        raise InvalidRequest(
            f"transformers could not load {path.name} ({type(exc).__name__}: {exc}); the file lacks fields a "
            f"GGUF export of a supported model carries"
        ) from exc
    missing = sorted(loading["missing_keys"])
    if missing:  # transformers would start those weights at random: a model that only looks loaded
        raise InvalidRequest(
            f"{path.name} has no tensors for {len(missing)} of the {model.config.model_type} model's weights "
            f"({', '.join(missing[:3])}, ...); it is not a complete export of that architecture"
        )
    out.mkdir(parents=True)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # the saved weights are plain float32, not GGUF blocks
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    save_model(model, str(out / "model.safetensors"))  # handles the tied embedding / lm_head pair
    gguf_blocks.save(model, reader, out / gguf_blocks.BLOCKS_FILE)  # the quantized blocks, for the panels
    tokenizer.save_pretrained(out)
    files = {p.name: _checksum(p) for p in sorted(out.iterdir())}
    (out / MANIFEST).write_text(json.dumps({"source": str(path), "files": files}, indent=1))


def _intact(entry: Path) -> bool:
    try:
        files = json.loads((entry / MANIFEST).read_text())["files"]
        present = {p.name for p in entry.iterdir()} - {MANIFEST}
        return present == set(files) and all(_checksum(entry / n) == c for n, c in files.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _digest(path: Path) -> str:
    """The cache key: sha256 of the GGUF file's content."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()[:32]


def _checksum(path: Path) -> str:
    """A damaged entry's detector, checked on every start: CRC-32 reads 540 MB in a fifth of sha256's time."""
    crc = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return f"crc32:{crc:08x}"
