"""text-generation-launcher's flags and env vars, accepted as they are, plus `--backend` and the engine options
TGI lacks (from the one declaration in paged_backend.engine.args, vLLM's forms included).

Each TGI flag reads the env var of its name in upper snake case (`--max-input-tokens` / MAX_INPUT_TOKENS) like
TGI's clap parser; command line beats `--config FILE` beats env beats default. An env value is checked as the flag's
own value would be (type, range, choices) once the command line and the config file have had their say, so
`--help` works whatever the environment holds and a bad value is refused naming the env var; an empty one counts as
unset, as clap has it. A flag that has no meaning for the chosen backend is still accepted, and `ignored_flags` names
it so the launcher can say so once. Usage errors are one line, `PROG: error: ... (see PROG --help)`, exit 2.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from paged_backend.config.env import switch_value
from paged_backend.engine.args import ENGINE_FLAGS, add_engine_arguments, parse_with_config
from paged_backend.tgi.http.settings import ROUTER_FLAG_FIELDS

BACKENDS = ("paged", "reference", "grpc")
ALL = frozenset(BACKENDS)
ROUTER = frozenset({"grpc"})  # knobs of the batching loop, which only our Python router runs
SHARDED = frozenset({"paged", "grpc"})  # backends that run tensor-parallel shards
LOADERS = frozenset({"paged", "reference"})  # backends that load the weights in this process
NONE: frozenset[str] = frozenset()
PAGED = frozenset({"paged"})


@dataclass(frozen=True)
class Flag:
    name: str
    type: Callable[[str], Any] | None  # None: a switch
    default: Any
    help: str
    used_by: frozenset[str] = ALL  # backends for which the flag changes anything
    env: str | None = None  # default: the name in upper snake case
    short: str | None = None
    choices: tuple[str, ...] | None = None

    @property
    def dest(self) -> str:
        return _dest(self.name)

    @property
    def env_var(self) -> str:
        return self.env or self.dest.upper()


def _dest(name: str) -> str:
    return name.removeprefix("--").replace("-", "_")


def _router_flag(name: str, kind: Callable[[str], Any] | None) -> Flag:
    """A flag the HTTP face's RouterSettings declares (http/settings.py): its default and help are read there."""
    declared = ROUTER_FLAG_FIELDS[_dest(name)]
    return Flag(name, kind, declared.default, declared.metadata["help"])


def _ranged(low: int, high: int | None = None) -> Callable[[str], int]:
    """An int flag in [low, high], as TGI's launcher types them (unsigned counts, a port): refused at parse time."""

    def parse(text: str) -> int:
        value = int(text)
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high if high is not None else 'inf'}], got {value}")
        return value

    parse.__name__ = "int"  # argparse names the type in its message: "invalid int value"
    return parse


COUNT, POSITIVE, PORT = _ranged(0), _ranged(1), _ranged(0, 65535)


def _boolean(text: str) -> str:
    if text.strip().lower() not in {"true", "false"}:
        raise argparse.ArgumentTypeError(f"must be true or false, got {text!r}")
    return text


def _switch(text: str) -> bool:
    """A switch's env value (TRUST_REMOTE_CODE=true), spelled as every environment switch here is."""
    if (value := switch_value(text)) is None:
        raise argparse.ArgumentTypeError(f"must be 1 or 0 (true/false, yes/no, on/off), got {text!r}")
    return value


def cuda_graph_sizes(text: str) -> list[int]:
    """TGI's `--cuda-graphs 1,2,4,8`: the batch sizes to capture, comma-separated (0: none); ValueError if not."""
    try:
        values = [int(size) for size in text.split(",") if size.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 0:
        raise ValueError(f"batch sizes like 1,2,4,8 (comma-separated; 0 for none), got {text!r}")
    return values


def _cuda_graphs(text: str) -> str:
    try:
        cuda_graph_sizes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"must be {error}") from error
    return text


FLAGS: list[Flag] = [
    Flag(
        "--backend", str, "paged", "paged | reference | grpc: which engine serves the TGI API", env="TGI_BACKEND",
        choices=BACKENDS,
    ),
    Flag("--model-id", str, None, "local directory, hub id or .gguf file; omit for the default model"),
    Flag("--tokenizer-name", str, None, "tokenizer directory or id when it differs from the model"),
    # grpc: passed on to the shards this launcher starts (--num-shard).
    Flag("--dtype", str, None, "float16 | bfloat16 | float32 (default: auto)", used_by=ALL),
    Flag(
        "--kv-cache-dtype", str, None, "KV pool dtype: fp8 | fp8_e4m3fn | fp8_e5m2 | float16 | bfloat16",
        frozenset({"paged"}),
    ),
    Flag(
        "--quantize", str, None, "weights: awq | gptq | bitsandbytes[-nf4|-fp4] | fp8 | eetq | marlin | exl2 | torchao",
        frozenset({"paged", "reference"}),
    ),
    Flag(
        "--device",
        str,
        "auto",
        "auto | cpu | cuda | cuda:N (paged-backend addition)",
        ALL,
    ),
    # accelerate's placement of a model bigger than one device (paged_backend.worker.offload).
    Flag("--device-map", str, None, "accelerate placement: auto | balanced | sequential | JSON", LOADERS),
    Flag("--max-memory", str, None, "accelerate's memory per device: 0=20GiB,cpu=60GiB", LOADERS),
    Flag("--cpu-offload-gb", float, None, "GiB of weights moved off the device (vLLM's name)", LOADERS),
    Flag("--offload-folder", str, None, "folder for disk-offloaded weights", LOADERS),
    Flag("--hostname", str, "0.0.0.0", "address to listen on"),
    Flag("--port", PORT, 3000, "HTTP port", short="-p"),
    _router_flag("--max-concurrent-requests", POSITIVE),
    _router_flag("--max-best-of", COUNT),
    _router_flag("--max-stop-sequences", COUNT),
    _router_flag("--max-top-n-tokens", COUNT),
    Flag("--max-input-tokens", POSITIVE, None, "longest prompt (default: max-total-tokens - 1)"),
    Flag("--max-input-length", POSITIVE, None, "legacy name of --max-input-tokens"),
    Flag("--max-total-tokens", POSITIVE, None, "longest prompt + output (default: the model's context)"),
    Flag("--max-batch-prefill-tokens", POSITIVE, 4096, "prompt tokens per forward", frozenset({"paged", "grpc"})),
    Flag("--max-batch-total-tokens", POSITIVE, None, "KV capacity in tokens (sizes the pool)", SHARDED),
    Flag("--max-batch-size", POSITIVE, None, "most requests per batch", frozenset({"paged", "grpc"})),
    Flag("--waiting-served-ratio", float, 0.3, "waiting/running ratio that triggers a prefill", ROUTER),
    Flag("--max-waiting-tokens", COUNT, 20, "decode steps before waiting requests are forced in", ROUTER),
    _router_flag("--max-client-batch-size", COUNT),
    Flag("--cuda-memory-fraction", float, 1.0, "fraction of device memory for the KV pool", frozenset({"paged"})),
    Flag("--block-size", POSITIVE, 16, "tokens per KV block (paged-backend addition)", frozenset({"paged", "grpc"})),
    Flag("--num-blocks", COUNT, None, "KV pool size in blocks, overrides memory sizing", frozenset({"paged", "grpc"})),
    _router_flag("--api-key", str),
    _router_flag("--payload-limit", POSITIVE),
    Flag("--graceful-termination-timeout", COUNT, 90, "seconds to drain requests on shutdown"),
    Flag("--shard-uds-path", str, "/tmp/text-generation-server", "shard socket prefix; rank 0 at {path}-0", ROUTER),
    Flag("--master-shard-uds-path", str, None, "socket of shard 0 (default: {shard-uds-path}-0)", ROUTER),
    _router_flag("--disable-grammar-support", None),
    _router_flag("--validation-workers", COUNT),
    # Accepted so TGI command lines keep working; reported as ignored when given.
    Flag("--revision", str, None, "hub revision", NONE),
    Flag("--json-output", None, False, "JSON log lines", NONE),
    Flag("--sharded", _boolean, None, "true | false: tensor parallelism", SHARDED),
    Flag("--num-shard", COUNT, None, "tensor-parallel shards (grpc: shard processes; paged: engine ranks)", SHARDED),
    Flag("--speculate", COUNT, None, "speculative tokens per step (paged: n-gram prompt lookup)", frozenset({"paged"})),
    Flag("--trust-remote-code", None, False, "run the model's own code (a checkpoint that ships modeling files)",
         LOADERS),
    Flag(
        "--cuda-graphs", _cuda_graphs, None,
        "CUDA graph batch sizes, comma-separated: the largest is the engine's max_cudagraph_capture_size (0: none)",
        PAGED,
    ),
    Flag("--master-addr", str, None, "torch.distributed address of the shards (default localhost)", ROUTER),
    Flag("--master-port", PORT, None, "torch.distributed port of the shards (default 29500)", ROUTER),
    Flag("--huggingface-hub-cache", str, None, "hub cache dir", NONE),
    Flag("--weights-cache-override", str, None, "weights cache dir", NONE),
    Flag("--disable-custom-kernels", None, False, "custom CUDA kernels", NONE),
    Flag("--rope-scaling", str, None, "RoPE scaling", NONE),
    Flag("--rope-factor", float, None, "RoPE factor", NONE),
    Flag("--lora-adapters", str, None, "LoRA adapters: id=path,... (requests pick one by adapter_id)", PAGED),
    Flag("--enable-prefill-logprobs", None, False, "prompt logprobs (always available here)", NONE),
    Flag("--watermark-gamma", float, None, "watermarking", NONE),
    Flag("--watermark-delta", float, None, "watermarking", NONE),
    Flag("--otlp-endpoint", str, None, "OTLP endpoint for one trace span per request (paged-backend[otel])"),
    Flag("--otlp-service-name", str, "text-generation-inference.router", "service.name of the spans"),
    Flag("--cors-allow-origin", str, None, "CORS", NONE),
    Flag("--prometheus-port", PORT, None, "separate metrics port (/metrics is on --port)", NONE),
    Flag("--tokenizer-config-path", str, None, "tokenizer config", NONE),
    Flag("--usage-stats", str, None, "telemetry", NONE),
    Flag("--max-image-fetch-size", COUNT, None, "image inputs", NONE),
    Flag("--ngrok", None, False, "ngrok tunnel", NONE),
    Flag("--env", None, False, "print the environment", NONE),
]


# Engine options TGI has under its own flag, with TGI's meaning (and default): launch takes the TGI flag only.
ENGINE_FLAG_ALIASES = {
    "model": "--model-id",
    "tokenizer": "--tokenizer-name",
    "quantization": "--quantize",  # TGI's method names (bitsandbytes-nf4, ...), mapped by worker.quantization.from_tgi
    "max_model_len": "--max-total-tokens",
    "max_num_seqs": "--max-batch-size",
    "max_num_batched_tokens": "--max-batch-prefill-tokens",
    "gpu_memory_utilization": "--cuda-memory-fraction",
    "tensor_parallel_size": "--num-shard",
    "lora_modules": "--lora-adapters",  # TGI's form: id=path,id2=path2
    "max_cudagraph_capture_size": "--cuda-graphs",  # TGI's batch-size list; its largest, by launch.cuda_graph_max
}
TGI_NAMES = {flag.name for flag in FLAGS}
# Engine options a TGI flag sets: engine field -> that flag's dest (an alias above, or the engine's own name).
ENGINE_FIELDS_FROM_TGI = {
    **{flag.field: _dest(flag.name) for flag in ENGINE_FLAGS if flag.name in TGI_NAMES},
    **{field: _dest(name) for field, name in ENGINE_FLAG_ALIASES.items()},
}
# The TGI flag to name when an engine field it set is refused (`--max-batch-size`, not `--max-num-seqs`).
TGI_FLAG_OF_FIELD = {field: "--" + dest.replace("_", "-") for field, dest in ENGINE_FIELDS_FROM_TGI.items()}
# The engine options launch adds: those no TGI flag sets.
ADDED_ENGINE_FIELDS = frozenset(flag.field for flag in ENGINE_FLAGS if flag.field not in ENGINE_FIELDS_FROM_TGI)


def usage_error(prog: str, message: str) -> str:
    """A usage error as one line: what to change, and where the flags are listed (argparse's 50-line usage is not)."""
    return f"{prog}: error: {message} (see {prog} --help)"


@dataclass(frozen=True)
class _FromEnv:
    """A flag's default taken from its env var: checked as the flag's value once parsing is done (`resolve`)."""

    flag: Flag
    raw: str

    def resolve(self) -> Any:
        flag, where = self.flag, f"env {self.flag.env_var}={self.raw!r} (sets {self.flag.name})"
        kind = flag.type or _switch
        try:
            value = kind(self.raw)
        except argparse.ArgumentTypeError as error:
            raise ValueError(f"{where}: {error}") from error
        except (TypeError, ValueError) as error:
            raise ValueError(f"{where}: invalid {getattr(kind, '__name__', 'value')} value") from error
        if flag.choices is not None and value not in flag.choices:
            raise ValueError(f"{where}: invalid choice (choose from {', '.join(map(repr, flag.choices))})")
        return value


class LaunchParser(argparse.ArgumentParser):
    """argparse with one-line usage errors, and env defaults checked after the command line had its say."""

    def error(self, message: str):
        self.exit(2, usage_error(self.prog, message) + "\n")

    def parse_args(self, args=None, namespace=None):
        parsed = super().parse_args(args, namespace)
        for dest, value in vars(parsed).items():
            if isinstance(value, _FromEnv):
                try:
                    setattr(parsed, dest, value.resolve())
                except ValueError as error:
                    self.error(str(error))
        return parsed


def build_parser(prog: str = "paged-backend launch") -> argparse.ArgumentParser:
    parser = LaunchParser(
        prog=prog,
        description="Serve the TGI HTTP API (text-generation-launcher flags and env vars) on paged-backend.",
    )
    for flag in FLAGS:
        raw_env = os.environ.get(flag.env_var, "")
        default = _FromEnv(flag, raw_env) if raw_env.strip() else flag.default
        names = [flag.short, flag.name] if flag.short else [flag.name]
        help_text = f"{flag.help} [env {flag.env_var}]"
        if flag.type is None:
            parser.add_argument(*names, dest=flag.dest, action="store_true", default=default, help=help_text)
        else:
            parser.add_argument(
                *names, dest=flag.dest, type=flag.type, default=default, choices=flag.choices, help=help_text,
                metavar="X",
            )
    add_engine_arguments(parser, skip={flag.field for flag in ENGINE_FLAGS} - ADDED_ENGINE_FIELDS)
    return parser


def parse_flags(argv: list[str], prog: str = "paged-backend launch") -> argparse.Namespace:
    args = parse_with_config(build_parser(prog), argv)
    if args.max_input_tokens is None:
        args.max_input_tokens = args.max_input_length
    return args


def ignored_flags(args: argparse.Namespace) -> list[str]:
    """Flags given (on the command line or by env) that change nothing for the chosen backend."""
    tgi = [flag.name for flag in FLAGS if args.backend not in flag.used_by and getattr(args, flag.dest) != flag.default]
    engine = [flag.name for flag in ENGINE_FLAGS if flag.field in ADDED_ENGINE_FIELDS and args.backend != "paged"
              and getattr(args, flag.field) is not None]  # fmt: skip
    return tgi + engine
