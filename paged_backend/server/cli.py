"""`paged-backend serve`: the OpenAI-compatible server. `register(app)` adds the command to a Typer app.

The engine flags come from the one declaration (paged_backend.engine.args); serve declares its server options,
and the model itself since it takes several (`--model a --model b`, or a `models:` list in `--config`)."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from paged_backend import startup
from paged_backend.config.env import env_seconds
from paged_backend.engine.args import CONFIG_HELP, EngineArgs, read_document
from paged_backend.engine.args_typer import FlagCommand, ModelArgument, add_engine_command
from paged_backend.errors import InvalidRequest, PagedBackendError, one_line

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")  # paged_backend.server.tool_parsers.TOOL_PARSERS' names
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's (and vLLM's choices)
LOG_STATS_INTERVAL_ENV = "VLLM_LOG_STATS_INTERVAL"  # vLLM's: seconds between stats lines (default 10)


def _known_tool_call_parser(name: str | None) -> str | None:
    if name is not None and name not in TOOL_CALL_PARSERS:
        raise typer.BadParameter(f"unknown tool-call parser {name!r}; choose one of {', '.join(TOOL_CALL_PARSERS)}")
    return name


def _uvicorn_log_level(level: str) -> str:
    if level.lower() not in UVICORN_LOG_LEVELS:
        raise typer.BadParameter(f"unknown log level {level!r}; choose one of {', '.join(UVICORN_LOG_LEVELS)}")
    return level.lower()


class ServeCommand(FlagCommand):
    """`serve`'s command line: a `models:` list in --config is serve's own section, not a flag."""

    config_sections = frozenset({"models"})  # --config's list of several models (server.multi_model reads it)


def serve(
    engine: EngineArgs,
    model_tag: ModelArgument = None,
    model: Annotated[
        list[str] | None,
        typer.Option(
            help="local directory, hub id or .gguf file; several serve several models; omit for the default model"
        ),
    ] = None,
    config: Annotated[
        str | None,
        typer.Option(
            metavar="FILE",
            help=f"{CONFIG_HELP}; a `models:` list in it serves several models, each with its own engine options",
        ),
    ] = None,
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on", min=0, max=65535)] = 8000,
    api_key: Annotated[
        list[str] | None,
        typer.Option(
            envvar="PAGED_BACKEND_API_KEY",
            help="require 'Authorization: Bearer <key>' (or x-api-key) on /v1; repeat for several keys",
        ),
    ] = None,
    max_concurrent_requests: Annotated[
        int | None,
        typer.Option(
            "--max-concurrent-requests", "--max-concurrency", min=1, help="generation requests in flight; more get 429"
        ),
    ] = None,
    max_request_body_bytes: Annotated[int, typer.Option(min=1, help="larger request bodies get 413")] = 1 << 20,
    drain_timeout: Annotated[
        float, typer.Option(min=0, help="seconds in-flight requests get to finish on shutdown before being aborted")
    ] = 10.0,
    served_model_name: Annotated[
        list[str] | None, typer.Option(help="model name in the API, one per --model; default: --model")
    ] = None,
    log_level: Annotated[
        str,
        typer.Option(
            "--uvicorn-log-level", "--log-level", callback=_uvicorn_log_level,
            help=f"uvicorn's log level: {' | '.join(UVICORN_LOG_LEVELS)} (the server's own lines stay at INFO)",
        ),
    ] = "info",
    disable_uvicorn_access_log: Annotated[bool, typer.Option(help="no uvicorn access line per request")] = False,
    root_path: Annotated[
        str | None,
        typer.Option(help="the path prefix a path-routing proxy serves this server under (e.g. /api); requests may "
                     "come with or without it"),
    ] = None,
    enable_log_requests: Annotated[
        bool, typer.Option(help="log each request received at INFO: its id, prompt, sampling params (vLLM's flag)")
    ] = False,
    disable_log_requests: Annotated[
        bool, typer.Option(help="vLLM's older flag: do not log requests (the default; wins over --enable-log-requests)")
    ] = False,
    max_log_len: Annotated[
        int | None,
        typer.Option(min=0, help="prompt characters and token ids a request's log line shows (default: all)"),
    ] = None,
    disable_log_stats: Annotated[
        bool,
        typer.Option(help=f"no periodic stats line (throughput, requests, KV cache use, prefix hits; every "
                     f"${LOG_STATS_INTERVAL_ENV} s, 10 by default, while busy)"),
    ] = False,
    response_role: Annotated[
        str, typer.Option(help="the role of chat completion answers to a generation prompt")
    ] = "assistant",
    return_tokens_as_token_ids: Annotated[
        bool, typer.Option(help='logprob tokens as "token_id:N" unless a request sets return_tokens_as_token_ids')
    ] = False,
    enable_prompt_tokens_details: Annotated[
        bool,
        typer.Option(help="chat and completions usage carries prompt_tokens_details.cached_tokens (prefix-cache hits)"),
    ] = False,
    enable_force_include_usage: Annotated[
        bool, typer.Option(help="streamed chat and completions end with usage even without stream_options")
    ] = False,
    enable_tokenizer_info_endpoint: Annotated[
        bool, typer.Option(help="serve GET /tokenizer_info: the tokenizer's config, class and chat template")
    ] = False,
    strict_fields: Annotated[
        bool, typer.Option(help="answer 400 to request fields this server does not know, instead of a logged warning")
    ] = False,
    enable_auto_tool_choice: Annotated[
        bool, typer.Option(help='let tool_choice "auto" parse tool calls out of the model\'s text (needs a parser)')
    ] = False,
    tool_call_parser: Annotated[
        str | None,
        typer.Option(
            help=f"tool-call format for auto: {', '.join(TOOL_CALL_PARSERS)}", callback=_known_tool_call_parser
        ),
    ] = None,
    otlp_traces_endpoint: Annotated[
        str | None, typer.Option(help="OTLP endpoint for one trace span per request (pip install paged-backend[otel])")
    ] = None,
    enable_debug_routes: Annotated[
        bool, typer.Option(help="serve GET /debug/kv, the KV pool block by block (what `paged-backend kv-map` draws)")
    ] = False,
    allow_runtime_lora_updating: Annotated[
        bool, typer.Option(help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes)")
    ] = False,
    max_stored_responses: Annotated[
        int, typer.Option(min=0, help="/v1/responses kept for GET and previous_response_id; the oldest go first")
    ] = 1000,
    stored_response_ttl: Annotated[float, typer.Option(min=0, help="seconds a stored response is kept")] = 3600.0,
    files_dir: Annotated[
        str | None,
        typer.Option(
            help="directory of /v1/files and /v1/batches (kept across restarts); default ~/.cache/paged_backend/files"
        ),
    ] = None,
    max_file_bytes: Annotated[int, typer.Option(min=1, help="larger /v1/files uploads get 413")] = 200 << 20,
    batch_completion_window: Annotated[
        float,
        typer.Option(
            min=0,
            metavar="SECONDS",
            help='seconds a batch (completion_window "24h") has to finish; unfinished lines then expire',
        ),
    ] = 24 * 3600.0,
    enable_sleep_mode: Annotated[
        bool,
        typer.Option(
            help="serve POST /sleep (level 1 frees the KV pool, 2 the weights too), /wake_up, GET /is_sleeping"
        ),
    ] = False,
    chat_template: Annotated[
        str | None,
        typer.Option(help="the chat template for every chat request, instead of the tokenizer's: a file, or inline"),
    ] = None,
    allowed_origins: Annotated[
        list[str] | None, typer.Option(help='CORS: origins browsers may call from (vLLM\'s flag; default "*")')
    ] = None,
    allowed_methods: Annotated[list[str] | None, typer.Option(help='CORS: methods allowed (default "*")')] = None,
    allowed_headers: Annotated[list[str] | None, typer.Option(help='CORS: headers allowed (default "*")')] = None,
    allow_credentials: Annotated[bool, typer.Option(help="CORS: let browsers send cookies and auth headers")] = False,
    trust_request_chat_template: Annotated[
        bool, typer.Option(help="render a request's own chat_template (a template is code run on this server)")
    ] = False,
) -> None:
    """Serve OpenAI /v1/completions and /v1/chat/completions, /v1/models, vLLM's /tokenize, /detokenize and
    /version, /health and /metrics."""
    import uvicorn

    from paged_backend.engine import Engine
    from paged_backend.engine.async_engine import EngineThread
    from paged_backend.server.app import RootPath, build_app
    from paged_backend.server.draining_server import DrainingServer
    from paged_backend.server.multi_model import build_engines, build_multi_model_app, model_specs
    from paged_backend.server.state import ServerSettings

    if enable_auto_tool_choice and tool_call_parser is None:
        typer.echo("error: --enable-auto-tool-choice needs --tool-call-parser NAME (the format to parse)", err=True)
        raise typer.Exit(2)
    try:
        stats_interval = env_seconds(LOG_STATS_INTERVAL_ENV, 10.0)
    except InvalidRequest as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from error
    configure_logging()
    try:
        template = server_chat_template(chat_template)
    except InvalidRequest as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from error
    models = [model_tag] if model_tag is not None else model or []  # vLLM's rule: the positional model wins
    names = served_model_name or []
    engine.model = models[0] if len(models) == 1 else None
    single = engines = engine_thread = None
    aliases = {}  # several models: each one's further served names
    try:
        models_file = config if config is not None and "models" in read_document(config) else None
        if models_file is None and len(models) <= 1:  # one model: several names are its aliases (vLLM's rule)
            engine_thread = EngineThread()  # built where it will step: see EngineThread
            single = engine_thread.submit(lambda: Engine(engine.to_engine_config())).result()
        else:  # several models: one engine and KV pool each, sharing one budget
            base = engine.to_engine_config()
            specs = model_specs(base, models, names, models_file)
            engines, aliases = build_engines(base, specs), {spec.name: spec.aliases for spec in specs}
    except (PagedBackendError, ValidationError) as error:
        typer.echo(f"error: {one_line(error)}", err=True)
        raise typer.Exit(2) from error
    settings = ServerSettings(
        api_key=api_key, max_concurrent_requests=max_concurrent_requests,
        max_request_body_bytes=max_request_body_bytes, drain_timeout=drain_timeout,
        served_model_name=names if engines is None else None, strict_fields=strict_fields,
        enable_auto_tool_choice=enable_auto_tool_choice, tool_call_parser=tool_call_parser,
        otlp_traces_endpoint=otlp_traces_endpoint,
        enable_debug_routes=enable_debug_routes,
        allow_runtime_lora_updating=allow_runtime_lora_updating,
        max_stored_responses=max_stored_responses, stored_response_ttl=stored_response_ttl,
        files_dir=files_dir, max_file_bytes=max_file_bytes, enable_sleep_mode=enable_sleep_mode,
        batch_completion_window=batch_completion_window, chat_template=template,
        trust_request_chat_template=trust_request_chat_template,
        response_role=response_role, return_tokens_as_token_ids=return_tokens_as_token_ids,
        enable_prompt_tokens_details=enable_prompt_tokens_details,
        enable_force_include_usage=enable_force_include_usage,
        enable_tokenizer_info_endpoint=enable_tokenizer_info_endpoint, root_path=root_path,
        enable_log_requests=enable_log_requests and not disable_log_requests, max_log_len=max_log_len,
        disable_log_stats=disable_log_stats, log_stats_interval=stats_interval,
        **cors_settings(allowed_origins, allowed_methods, allowed_headers, allow_credentials),
    )  # fmt: skip
    try:
        if engines is None:
            app = build_app(single, settings, engine_thread=engine_thread)
            draining = app.state.server.async_engine
        else:
            app = draining = build_multi_model_app(engines, settings, aliases)
            if root_path:  # the router and its shared routes see the route's path too
                app = RootPath(app, root_path=root_path)
    except RuntimeError as error:  # tracing asked for without the SDK, or an unknown OTLP protocol
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from error
    # The engine drains first; uvicorn's own timeout is only a backstop for connections that still hang.
    server_config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                                   access_log=not disable_uvicorn_access_log)  # fmt: skip
    server = DrainingServer(server_config, draining, drain_timeout)
    startup.started()
    try:
        server.run()
    finally:
        for each in [single] if engines is None else engines.values():
            each.close()  # stops the worker ranks of a parallel engine
    if server.exit_code:
        raise typer.Exit(server.exit_code)


def configure_logging() -> None:
    """The server's own log lines (request lines, stats, warnings) on stderr at INFO, as vLLM's logger prints them,
    whatever uvicorn's level; once, and only where nothing configured the package's logger already."""
    package = logging.getLogger("paged_backend")
    if package.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s", "%m-%d %H:%M:%S"))
    package.addHandler(handler)
    package.setLevel(logging.INFO)


def cors_settings(origins, methods, headers, credentials: bool) -> dict:
    """The CORS fields of ServerSettings; a flag not given keeps vLLM's "*". vLLM takes each list as JSON text
    (`--allowed-origins '["https://a.example"]'`): that form is read too, besides the flag repeated."""

    def values(given: list[str] | None) -> list[str] | None:
        if not given:
            return None
        if len(given) == 1 and given[0].lstrip().startswith("["):
            try:
                parsed = json.loads(given[0])
            except json.JSONDecodeError:
                parsed = None
            if isinstance(parsed, list) and all(isinstance(item, str) for item in parsed):
                return parsed
        return given

    chosen = {"allowed_origins": values(origins), "allowed_methods": values(methods),
              "allowed_headers": values(headers)}  # fmt: skip
    return {"allow_credentials": credentials, **{name: value for name, value in chosen.items() if value is not None}}


def server_chat_template(given: str | None) -> str | None:
    """`--chat-template`: a file's text, or the template itself when it is written inline (vLLM's rule)."""
    if given is None:
        return None
    if os.path.isfile(given):
        try:
            return Path(given).read_text()
        except (OSError, UnicodeDecodeError) as error:
            raise InvalidRequest(f"--chat-template: cannot read {given} as text ({error})") from error
    if "{" not in given:  # neither a file nor a template: a path that is wrong
        raise InvalidRequest(f"--chat-template: no such file {given!r} (an inline template has {{{{ or {{% in it)")
    return given


def register(app: typer.Typer) -> None:
    """Add the `serve` command to a Typer app (the `paged-backend` CLI)."""
    add_engine_command(app, "serve", serve, ServeCommand)
