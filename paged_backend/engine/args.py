"""The engine's command-line options, declared once (vLLM's `EngineArgs`): `run`, `serve`, `bench throughput`,
`bench latency` and `launch` all build their engine flags from this model, so no face can lack one
(tests/test_flag_parity.py checks it).

Each field is the EngineConfig field of the same name (the cache, scheduler and parallel groups flattened) and
defaults to None, "not given", so an unset flag keeps the config's own default: one source for every default.
The flag is the field's name in kebab case unless `_option` names it otherwise (`--kv-cache-dtype`).
`args_typer` turns the fields into typer options, `add_engine_arguments` into argparse ones.

>>> EngineArgs(block_size=8, max_num_seqs=4).to_engine_config().cache.block_size
8
"""

from __future__ import annotations

import argparse
import json
import sys
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from paged_backend.config import EngineConfig
from paged_backend.errors import InvalidRequest
from paged_backend.lora.request import parse_lora_modules


def _option(help: str, *flags: str) -> Any:
    """A field that is one engine option; `flags` replace the default `--field-name` (first: the long name)."""
    return Field(None, description=help, json_schema_extra={"flags": list(flags)} if flags else None)


class EngineArgs(BaseModel):
    """Values of the engine flags; None means "not given on the command line"."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = _option("local directory, hub id or .gguf file (run and serve also take it as the positional "
                                "MODEL); omit for the default model, SmolLM2-135M-Instruct; "
                                "paged-backend/embedded-tiny is the seeded tiny model")  # fmt: skip
    tokenizer: str | None = _option("tokenizer directory or id; default: the model's")
    tokenizer_mode: str | None = _option(
        "auto | hf: the model's Hugging Face tokenizer (vLLM's slow, mistral and custom are refused)"
    )
    trust_remote_code: bool | None = _option(
        "run the Python code a model's repository ships (its auto_map config, model and tokenizer classes)"
    )
    dtype: str | None = _option("auto | float32 | float16 | bfloat16")
    device: str | None = _option("auto | cpu | cuda | cuda:N")
    seed: int | None = _option("engine seed for unseeded sampling")
    quantization: str | None = _option(
        "awq | gptq | fp8 | bitsandbytes | compressed-tensors | torchao", "--quantization", "-q"
    )
    quantization_param: str | None = _option("scheme, e.g. int8_weight_only | int4_weight_only | nf4")
    # Bigger than one device, through accelerate (paged_backend.worker.offload).
    device_map: str | None = _option("accelerate placement: auto | balanced | sequential | JSON {module: device}")
    max_memory: str | None = _option("accelerate's memory per device: 0=20GiB,cpu=60GiB (or JSON)")
    cpu_offload_gb: float | None = _option("GiB of weights moved off the device: GPU -> CPU memory (on CPU: -> disk)")
    offload_folder: str | None = _option("folder for disk-offloaded weights of non-safetensors checkpoints")
    attention_backend: str | None = _option("auto | torch | cpu | triton | cuda")
    enforce_eager: bool | None = _option("vLLM's flag: no CUDA graphs, no compiled steps")
    max_cudagraph_capture_size: int | None = _option(
        "GPU: decode steps of up to this many sequences replay captured CUDA graphs (default 0: off)"
    )
    prepack_weights: bool | None = _option("CPU: linear layers on oneDNN-prepacked weights (default on)")
    batch_invariant: bool | None = _option(
        "bitwise the same tokens and logprobs for a request alone or in any batch (slower; default: "
        "PAGED_BACKEND_BATCH_INVARIANT=1)"
    )
    enable_lora: bool | None = _option("serve LoRA adapters (vLLM's flag)")
    max_loras: int | None = _option("most LoRA adapters in one batch")
    max_lora_rank: int | None = _option("largest LoRA rank accepted")
    lora_modules: list[str] | None = _option(
        'adapters: name=path or JSON {"name": .., "path": .., "base_model_name": ..}; several after one flag, or repeat'
    )
    speculative_config: str | None = _option(
        'JSON, e.g. {"method": "ngram", "num_speculative_tokens": 3} or {"model": PATH, "num_speculative_tokens": 3}'
    )
    generation_config: str | None = _option(
        "auto | vllm | FOLDER: sampling defaults for the fields a request leaves out, from the model's "
        "generation_config.json (auto, the default), none (vllm), or a folder's"
    )
    override_generation_config: str | None = _option(
        'JSON sampling defaults over those, e.g. \'{"temperature": 0.5, "max_new_tokens": 256}\''
    )
    # CacheConfig
    block_size: int | None = _option("tokens per KV block (power of two, 1..256)")
    num_blocks: int | None = _option("KV pool size in blocks; overrides the memory budget")
    kv_cache_memory_bytes: int | None = _option("KV pool size in bytes; overrides the memory fraction")
    gpu_memory_utilization: float | None = _option("fraction of free device memory for the KV pool")
    swap_space: float | None = _option("GiB of CPU memory for swapped-out KV blocks")
    cache_dtype: str | None = _option(
        "auto | bfloat16 | float16 | float32 | fp8 | fp8_e4m3 | fp8_e5m2", "--kv-cache-dtype"
    )
    calculate_kv_scales: bool | None = _option("fp8 KV: per-layer scales from the first step")
    enable_prefix_caching: bool | None = _option("share identical prompt blocks")
    watermark: float | None = _option("fraction of KV blocks kept free when admitting requests")
    # SchedulerConfig
    max_num_seqs: int | None = _option("most sequences in one step")
    max_num_batched_tokens: int | None = _option("most tokens in one step")
    max_model_len: int | None = _option("longest prompt + output")
    enable_chunked_prefill: bool | None = _option("split long prompts over several steps")
    policy: str | None = _option(
        "fcfs | priority: smaller 'priority' first, and a waiting request preempts running lower-priority ones "
        "(run: the JSONL 'priority' field)",
        "--scheduling-policy",
        "--policy",
    )
    preemption_mode: str | None = _option("recompute | swap; default: swap when there is swap space")
    disable_hybrid_kv_cache_manager: bool | None = _option(
        "one block table for every layer: sliding-window layers keep all their blocks"
    )
    # ParallelConfig
    tensor_parallel_size: int | None = _option(
        "ranks that split every layer's heads and MLP", "--tensor-parallel-size", "-tp"
    )
    pipeline_parallel_size: int | None = _option(
        "stages that split the decoder layers", "--pipeline-parallel-size", "-pp"
    )
    distributed_executor_backend: str | None = _option(
        "mp | ray; default: mp, or torchrun's ranks when run under torchrun"
    )
    distributed_timeout_seconds: float | None = _option("seconds a collective waits for a rank before failing")

    def engine_kwargs(self) -> dict[str, Any]:
        """The options given, as the flat keywords `engine_config` and `LLM` take (`--lora-modules` parsed)."""
        given = self.model_dump(exclude_none=True)
        if "lora_modules" in given:
            given["lora_modules"] = parse_lora_modules(given["lora_modules"])
        return given

    def to_engine_config(self) -> EngineConfig:
        """The config with every given flag set on the field of the same name."""
        from paged_backend.engine import engine_config

        return engine_config(**self.engine_kwargs())

    @classmethod
    def from_namespace(cls, namespace: argparse.Namespace, fields: Iterable[str] | None = None) -> EngineArgs:
        """The engine options (of `fields`, default all) a parser built by `add_engine_arguments` read."""
        names = cls.model_fields if fields is None else fields
        return cls(**{name: getattr(namespace, name) for name in names if hasattr(namespace, name)})


@dataclass(frozen=True)
class EngineFlag:
    """How one EngineArgs field appears on a command line."""

    field: str
    names: tuple[str, ...]  # the long name first, then aliases (`-tp`)
    kind: type  # bool (--x/--no-x), list (several values), or the value's type
    help: str

    @property
    def name(self) -> str:
        return self.names[0]


def _kind(annotation) -> type:
    (value_type,) = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    return typing.get_origin(value_type) or value_type


ENGINE_FLAGS: tuple[EngineFlag, ...] = tuple(
    EngineFlag(
        name,
        tuple((field.json_schema_extra or {}).get("flags") or ["--" + name.replace("_", "-")]),
        _kind(field.annotation),
        field.description or "",
    )
    for name, field in EngineArgs.model_fields.items()
)


@cache  # the flags are fixed at import; LLM() and every models-file entry ask
def option_fields() -> dict[str, str]:
    """Every spelling of an engine option, underscored, -> the field it sets: the field's own name and each long
    flag's (`kv_cache_dtype` sets `cache_dtype`, `scheduling_policy` sets `policy`), as vLLM's `LLM(**kwargs)` and
    config files spell them."""
    fields = {}
    for flag in ENGINE_FLAGS:
        for spelling in (flag.field, *(name[2:] for name in flag.names if name.startswith("--"))):
            fields[spelling.replace("-", "_")] = flag.field
    return fields


CONFIG_HELP = "vLLM's config file (YAML, or TOML): keys are flag names (- or _); flags on the command line win"


class _Values(argparse.Action):
    """Several values after one flag (`--x a b`) and repeats (`--x a --x b`) add up; the first use on the command
    line replaces a default that came from --config, so the command line wins."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        current = getattr(namespace, self.dest, None)
        earlier = [] if current is self.default or current is None else current
        setattr(namespace, self.dest, [*earlier, *values])


def add_engine_arguments(parser: argparse.ArgumentParser, skip: frozenset[str] | set[str] = frozenset()) -> None:
    """One argparse option per engine field, and `--config`; `skip`: fields the face declares under its own flag."""
    parser.add_argument("--config", default=None, metavar="FILE", help=CONFIG_HELP)
    for flag in ENGINE_FLAGS:
        if flag.field in skip:
            continue
        if flag.kind is bool:
            kind = dict(action=argparse.BooleanOptionalAction)
        elif flag.kind is list:
            kind = dict(action=_Values, nargs="+", metavar="VALUE")
        else:
            kind = dict(type=flag.kind, metavar=flag.kind.__name__.upper())
        parser.add_argument(*flag.names, dest=flag.field, default=None, help=flag.help, **kind)


def config_path(argv: list[str]) -> str | None:
    """The FILE of `--config FILE` or `--config=FILE` in `argv`, if any."""
    for index, token in enumerate(argv):
        if token == "--config" and index + 1 < len(argv):
            return argv[index + 1]
        if token.startswith("--config="):
            return token.removeprefix("--config=")
    return None


def read_document(path: str) -> dict[str, Any]:
    """A YAML file (TOML when its name ends in .toml) whose top level is a mapping."""
    import yaml

    try:
        text = Path(path).read_text()
        if path.endswith(".toml"):
            import tomllib

            document = tomllib.loads(text)
        else:
            document = yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as error:
        raise InvalidRequest(f"cannot read the config file {path}: {_one_line_reason(error)}") from error
    if not isinstance(document, dict):
        raise InvalidRequest(f"{path}: a config file maps flag names to values, e.g. `max-num-seqs: 8`")
    return document


def _one_line_reason(error: Exception) -> str:
    """pyyaml's errors span several lines (the context, the problem, a caret under the text): the problem and where."""
    import yaml

    if isinstance(error, yaml.MarkedYAMLError) and error.problem_mark is not None:
        mark = error.problem_mark
        return f"not valid YAML: {error.problem} (line {mark.line + 1}, column {mark.column + 1})"
    return " ".join(str(error).split())


def read_config_file(path: str) -> dict[str, Any]:
    """vLLM's `--config` file as {flag name: value}, keys with - or _ alike. A mapping value becomes its JSON
    text, as the flag takes it (`speculative-config: {method: ngram, num_speculative_tokens: 2}`)."""
    document = read_document(path)

    def as_flag_value(value):
        if isinstance(value, dict):
            return json.dumps(value)
        return [as_flag_value(item) for item in value] if isinstance(value, list) else value

    return {str(key).replace("_", "-"): as_flag_value(value) for key, value in document.items()}


def parse_with_config(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """`parser.parse_args(argv)` (default: sys.argv[1:]), after the keys of `--config FILE` became the parser's
    defaults, so the command line wins."""
    argv = sys.argv[1:] if argv is None else argv
    path = config_path(argv)
    if path is not None:
        try:
            values = read_config_file(path)
        except InvalidRequest as error:
            parser.error(str(error))
        parser.set_defaults(**_parsed_config(parser, path, values))
    return parser.parse_args(argv)


def _parsed_config(parser: argparse.ArgumentParser, path: str, values: dict[str, Any]) -> dict[str, Any]:
    """The config's values as the parser reads them (types converted), keyed by destination."""
    tokens = []
    for key, value in values.items():
        if isinstance(value, bool):
            tokens.append(f"--{key}" if value else f"--no-{key}")
        elif value is not None:
            tokens += [f"--{key}", *map(str, value if isinstance(value, list) else [value])]
    defaults = vars(parser.parse_known_args([])[0])
    configured, extra = parser.parse_known_args(tokens)
    # `key: false` for a plain switch (one without a --no-key form) leaves it off, which is its default anyway.
    unknown = [token[2:] for token in extra if token.startswith("--")
               and values.get(token[2:].removeprefix("no-")) is not False]  # fmt: skip
    if unknown:
        parser.error(f"{path}: unknown key(s) {', '.join(unknown)}; the keys are this command's flag names")
    return {dest: value for dest, value in vars(configured).items() if value != defaults.get(dest)}
