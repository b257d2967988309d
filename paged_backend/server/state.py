"""What the routes share: settings, the async engine, metrics, and the served model's name."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import Request
from transformers import PreTrainedTokenizerBase

from paged_backend.engine.async_engine import AsyncEngine
from paged_backend.lora import LoRARequest
from paged_backend.lora.manager import served_adapters
from paged_backend.observability.metrics import ServerMetrics
from paged_backend.server.batch_store import COMPLETION_WINDOW
from paged_backend.server.openai_errors import ModelNotFound


@dataclass
class ServerSettings:
    """HTTP-level limits and behaviour; engine settings live in EngineConfig."""

    api_key: str | list[str] | None = None  # one key or several; each key's stored responses are its own
    max_concurrent_requests: int | None = None  # generation requests in flight; more get 429
    max_request_body_bytes: int = 1 << 20  # larger bodies get 413
    drain_timeout: float = 10.0  # seconds in-flight requests get to finish on shutdown
    served_model_name: str | list[str] | None = None  # default: --model; several: the first answers, all are taken
    strict_fields: bool = False  # unknown request fields are a 400 instead of a logged warning
    enable_auto_tool_choice: bool = False  # tool_choice "auto" parses calls out of the text (vLLM's flag)
    tool_call_parser: str | None = None  # which format "auto" parses: hermes, llama3_json or mistral
    otlp_traces_endpoint: str | None = None  # OTLP collector for one span per request (vLLM's flag)
    enable_debug_routes: bool = False  # GET /debug/kv (the KV pool map's data); off: 404
    allow_runtime_lora_updating: bool = False  # /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's)
    max_stored_responses: int = 1000  # /v1/responses kept for GET and previous_response_id; the oldest go first
    stored_response_ttl: float = 3600.0  # seconds a stored response is kept
    files_dir: str | None = None  # /v1/files and /v1/batches live here; default: ~/.cache/paged_backend/files
    max_file_bytes: int = 200 << 20  # larger /v1/files uploads get 413
    batch_completion_window: float = COMPLETION_WINDOW  # seconds a batch ("24h") has to finish before it expires
    enable_sleep_mode: bool = False  # POST /sleep, /wake_up and GET /is_sleeping (vLLM's routes); off: 404
    chat_template: str | None = None  # replaces the tokenizer's template for every chat request (vLLM's flag)
    trust_request_chat_template: bool = False  # render a request's own chat_template (code run here)
    response_role: str = "assistant"  # the role of chat answers to a generation prompt (vLLM's --response-role)
    # Server-wide defaults of request fields (vLLM's flags): the routes apply them (`apply_server_defaults`)
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:N" unless a request says otherwise
    enable_force_include_usage: bool = False  # streams end with usage even without stream_options.include_usage
    enable_prompt_tokens_details: bool = False  # chat / completions usage carries prompt_tokens_details.cached_tokens
    enable_tokenizer_info_endpoint: bool = False  # GET /tokenizer_info (vLLM's route); off: 404
    root_path: str | None = None  # the prefix a path-routing proxy serves this server under (vLLM's --root-path)
    # Logs (vLLM's flags and defaults): one line per request received, and the engine's stats every interval
    enable_log_requests: bool = False  # "Received request ..." at INFO
    max_log_len: int | None = None  # prompt characters / token ids a request line shows; None: all
    disable_log_stats: bool = False  # no periodic stats line
    log_stats_interval: float = 10.0  # seconds between stats lines (vLLM's VLLM_LOG_STATS_INTERVAL)
    # CORS for browser clients, vLLM's flags and defaults: any origin, method and header, no credentials
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False

    @property
    def api_keys(self) -> list[str]:
        return [self.api_key] if isinstance(self.api_key, str) else list(self.api_key or [])

    @property
    def cors_options(self) -> dict:
        """Starlette's CORSMiddleware arguments."""
        return dict(allow_origins=self.allowed_origins, allow_methods=self.allowed_methods,
                    allow_headers=self.allowed_headers, allow_credentials=self.allow_credentials)  # fmt: skip

    @property
    def served_names(self) -> list[str]:
        names = self.served_model_name
        return [names] if isinstance(names, str) else list(names or [])


@dataclass
class ServerState:
    settings: ServerSettings
    async_engine: AsyncEngine
    metrics: ServerMetrics
    model_name: str  # the name answers give
    aliases: tuple[str, ...] = ()  # more names requests may use for the same model (vLLM's --served-model-name a b)

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.model_name, *self.aliases)

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.async_engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.async_engine.engine.max_model_len

    @property
    def sampling_defaults(self) -> dict:
        """SamplingParams fields -> the value a request that leaves them out gets (the engine's generation config)."""
        return self.async_engine.engine.sampling_defaults

    def check_model(self, requested: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model, also when omitted). OpenAI answers 404
        model_not_found for a model it does not serve."""
        if requested is None or requested in self.model_names:
            return None
        adapter = served_adapters(self.async_engine.engine).get(requested)
        if adapter is None:
            served = ", ".join(f"'{name}'" for name in [*self.model_names, *served_adapters(self.async_engine.engine)])
            raise ModelNotFound(f"model '{requested}' is not served here; this server serves {served}")
        return LoRARequest(adapter.name, adapter.int_id, adapter.path)

    def answered_as(self, requested: str | None) -> str:
        """The `model` an answer names: the adapter the request asked for (vLLM's rule), else the served model."""
        return requested if requested in served_adapters(self.async_engine.engine) else self.model_name


def server_state(request: Request) -> ServerState:
    return request.app.state.server
