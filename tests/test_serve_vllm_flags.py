"""vLLM `serve` flags that launch scripts carry: a realistic vLLM command line starts the server and each flag does
what it does in vLLM (response role, forced stream usage, prompt-token details, token ids in logprobs, the
tokenizer-info route, root path, request and stats log lines, uvicorn's log level and access log, remote code);
the refused tokenizer modes are one line each; the stats line and the info route are checked in-process too."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import typer
from _server_helpers import API_KEY, running_server
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from paged_backend.cli import app as cli_app
from paged_backend.engine import LLM, Engine, engine_config
from paged_backend.errors import InvalidRequest
from paged_backend.observability.stats_log import StatsLogger
from paged_backend.server.app import build_app
from paged_backend.server.state import ServerSettings
from paged_backend.worker import models
from paged_backend.worker.default_model import TINY_MODEL
from paged_backend.worker.models import byte_tokenizer, tiny_model

NAME = "tiny"  # --served-model-name
PROMPT = "Hello from the request log test"
MAX_LOG_LEN = 12


def remote_code_model(folder: Path) -> Path:
    """A local model whose config and model classes are code in the folder (auto_map), as hub models with custom
    code ship them: transformers loads it only with trust_remote_code."""
    tiny_model("llama", seed=3).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    (folder / "configuration_remote.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass RemoteLlamaConfig(LlamaConfig):\n"
        "    model_type = 'remote_llama'\n"
    )
    (folder / "modeling_remote.py").write_text(
        "from transformers import LlamaForCausalLM\n\nfrom .configuration_remote import RemoteLlamaConfig\n\n\n"
        "class RemoteLlamaForCausalLM(LlamaForCausalLM):\n    config_class = RemoteLlamaConfig\n"
    )
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="remote_llama", architectures=["RemoteLlamaForCausalLM"],
                  auto_map={"AutoConfig": "configuration_remote.RemoteLlamaConfig",
                            "AutoModelForCausalLM": "modeling_remote.RemoteLlamaForCausalLM"})  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def remote_model(tmp_path_factory) -> Path:
    return remote_code_model(tmp_path_factory.mktemp("models") / "remote_llama")


@pytest.fixture(scope="module")
def server(remote_model):
    flags = [str(remote_model), "--served-model-name", NAME, "--trust-remote-code", "--tokenizer-mode", "hf",
             "--dtype", "float32", "--num-blocks", "64", "--enable-log-requests", "--max-log-len", str(MAX_LOG_LEN),
             "--uvicorn-log-level", "info", "--disable-uvicorn-access-log", "--enable-tokenizer-info-endpoint",
             "--response-role", "bot", "--enable-force-include-usage", "--enable-prompt-tokens-details",
             "--return-tokens-as-token-ids", "--root-path", "/api"]  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_LOG_STATS_INTERVAL", "0.5")  # vLLM's variable; 10 s by default
        with running_server(*flags, model=None) as running:
            yield running


def sse_chunks(response: httpx.Response) -> list[dict]:
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_the_remote_code_model_serves_and_chat_answers_in_the_response_role(server):
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True}
    answer = server.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["role"] == "bot"
    first = sse_chunks(server.post("/v1/chat/completions", json={**body, "stream": True}))[0]
    assert first["choices"][0]["delta"]["role"] == "bot"
    continued = {**body, "messages": [*body["messages"], {"role": "assistant", "content": "Hel"}],
                 "add_generation_prompt": False, "continue_final_message": True}  # fmt: skip
    assert server.post("/v1/chat/completions", json=continued).json()["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streams_end_with_usage_and_its_cached_tokens_without_stream_options(server, path):
    body = {"model": NAME, "max_tokens": 4, "ignore_eos": True, "stream": True}
    body |= {"prompt": "A shared prompt of some length, twice"} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "A shared prompt of some length, twice"}]}  # fmt: skip
    server.post(path, json={**body, "stream": False})  # publishes the prompt's blocks
    chunks = sse_chunks(server.post(path, json=body))
    assert all(chunk.get("usage") is None for chunk in chunks[:-1]) and chunks[-1]["choices"] == []
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 4 and usage["prompt_tokens_details"]["cached_tokens"] > 0
    asked = sse_chunks(server.post(path, json={**body, "stream_options": {"include_usage": False,
                                                                          "continuous_usage_stats": True}}))
    assert all(chunk["usage"] is not None for chunk in asked)  # forced on; continuous stats stay the request's
    whole = server.post(path, json={**body, "stream": False}).json()["usage"]
    assert whole["prompt_tokens_details"]["cached_tokens"] > 0


def test_logprob_tokens_are_token_ids_unless_the_request_says_otherwise(server):
    body = {"model": NAME, "prompt": "Hi", "max_tokens": 2, "ignore_eos": True, "logprobs": 1}
    tokens = server.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["tokens"]
    assert all(token.startswith("token_id:") for token in tokens)
    text = server.post("/v1/completions", json={**body, "return_tokens_as_token_ids": False}).json()
    assert not any(token.startswith("token_id:") for token in text["choices"][0]["logprobs"]["tokens"])


@pytest.mark.parametrize("prefix", ["", "/api"])
def test_tokenizer_info_gives_what_lm_eval_remote_tokenizer_reads_under_the_root_path_or_without(server, prefix):
    info = httpx.get(f"{server.url}{prefix}/tokenizer_info", timeout=30)
    assert info.status_code == 200, info.text
    info = info.json()
    assert (info["eos_token"], info["bos_token"], info["pad_token"]) == ("<|eos|>", "<|bos|>", "<|pad|>")
    assert info["tokenizer_class"] and "assistant" in info["chat_template"] and "vocab_file" not in info
    # lm-eval's RemoteTokenizer: the eos token's id through /tokenize, then text back through /detokenize
    tokens = server.post(f"{prefix}/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False})
    assert tokens.json()["tokens"] == [byte_tokenizer().eos_token_id]
    assert server.post(f"{prefix}/detokenize", json={"tokens": list(b"hi")}).json()["prompt"] == "hi"


def test_the_root_path_prefix_is_optional_and_keeps_the_api_key(server):
    for path in ("/v1/models", "/api/v1/models"):
        assert httpx.get(f"{server.url}{path}", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
        assert httpx.get(f"{server.url}{path}").status_code == 401  # the prefix does not slip past the key
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/api/v1", api_key=API_KEY, max_retries=0, timeout=120)
    assert [model.id for model in client.models.list().data] == [NAME]


def wait_for_line(server, text: str, timeout: float = 15) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = [line for line in server.output().splitlines() if text in line]
        if lines:
            return lines
        time.sleep(0.1)
    raise AssertionError(f"no {text!r} line in:\n{server.output()}")


def test_request_lines_stats_lines_and_uvicorn_logs(server):
    assert server.post("/v1/completions", json={"model": NAME, "prompt": PROMPT, "max_tokens": 2}).status_code == 200
    [line] = [line for line in wait_for_line(server, "Received request cmpl-") if PROMPT[:MAX_LOG_LEN] in line]
    assert "INFO" in line and f"prompt: {PROMPT[:MAX_LOG_LEN]!r}," in line and PROMPT[: MAX_LOG_LEN + 1] not in line
    assert f"prompt_token_ids: {list(PROMPT[:MAX_LOG_LEN].encode())}" in line and "params: SamplingParams(n=1" in line
    stats = wait_for_line(server, "Avg prompt throughput")[-1]
    assert f"{NAME}: Avg prompt throughput" in stats and "INFO" in stats
    assert all(part in stats for part in ("Avg generation throughput", "Running:", "Waiting:", "KV cache usage:",
                                          "Prefix cache hit rate:"))  # fmt: skip
    output = server.output()
    assert "Application startup complete" in output  # --uvicorn-log-level info
    assert "HTTP/1.1" not in output  # --disable-uvicorn-access-log


def test_a_remote_code_model_loads_only_when_trusted_and_every_loader_is_told(remote_model, monkeypatch):
    with pytest.raises(InvalidRequest, match="--trust-remote-code"):
        LLM(str(remote_model), device="cpu", num_blocks=16)
    seen = []
    for loader in ("AutoConfig", "AutoModelForCausalLM", "AutoTokenizer"):
        cls = getattr(models, loader)
        monkeypatch.setattr(models, loader, type(loader, (), {"from_pretrained": staticmethod(
            lambda *args, _cls=cls, _name=loader, **kwargs: seen.append((_name, kwargs.get("trust_remote_code")))
            or _cls.from_pretrained(*args, **kwargs))}))  # fmt: skip
    llm = LLM(str(remote_model), device="cpu", num_blocks=16, dtype="float32", trust_remote_code=True)
    assert type(llm.engine.model).__name__ == "RemoteLlamaForCausalLM"
    assert sorted(seen) == [("AutoConfig", True), ("AutoModelForCausalLM", True), ("AutoTokenizer", True)]


@pytest.mark.parametrize("mode", ["slow", "mistral", "custom", "bogus"])
def test_a_tokenizer_mode_this_engine_does_not_run_is_one_line_naming_it(mode):
    result = CliRunner().invoke(cli_app, ["serve", "--model", TINY_MODEL, "--device", "cpu", "--tokenizer-mode", mode])
    assert result.exit_code == 2 and "Traceback" not in result.output
    [line] = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith("error: --tokenizer-mode: ") and repr(mode) in line and "use auto or hf" in line
    with pytest.raises(ValueError, match="use auto or hf"):
        engine_config(tokenizer_mode=mode)


def test_a_bad_uvicorn_log_level_is_a_usage_error():
    result = CliRunner().invoke(cli_app, ["serve", "--uvicorn-log-level", "loud"])
    assert result.exit_code == 2 and "trace" in result.output


def test_the_flags_are_config_file_keys(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("trust-remote-code: true\ntokenizer_mode: hf\nenable-log-requests: true\nmax-log-len: 5\n"
                      "disable_log_stats: true\nuvicorn-log-level: warning\ndisable-uvicorn-access-log: true\n"
                      "root-path: /api\nresponse-role: bot\nreturn-tokens-as-token-ids: true\n"
                      "enable-prompt-tokens-details: true\nenable-force-include-usage: true\n"
                      "enable-tokenizer-info-endpoint: true\ndisable-log-requests: false\n")  # fmt: skip
    command = typer.main.get_command(cli_app).commands["serve"]
    params = command.make_context("serve", ["--config", str(config)]).params
    assert (params["trust_remote_code"], params["tokenizer_mode"], params["log_level"]) == (True, "hf", "warning")
    assert (params["enable_log_requests"], params["max_log_len"], params["disable_log_stats"]) == (True, 5, True)
    assert (params["root_path"], params["response_role"], params["enable_tokenizer_info_endpoint"]) == ("/api", "bot",
                                                                                                        True)


@pytest.fixture(scope="module")
def engine():
    return Engine(engine_config(model=TINY_MODEL, device="cpu", num_blocks=64))


def test_in_process_stats_line_after_traffic_none_when_disabled_and_no_tokenizer_info_by_default(engine, caplog):
    caplog.set_level(logging.INFO, logger="paged_backend")
    body = {"prompt": "Hello", "max_tokens": 3, "ignore_eos": True}
    for disabled in (False, True):
        caplog.clear()
        settings = ServerSettings(log_stats_interval=0.05, disable_log_stats=disabled)
        with TestClient(build_app(engine, settings)) as client:
            assert client.get("/tokenizer_info").status_code == 404  # off unless enabled, as in vLLM
            assert client.post("/v1/completions", json=body).status_code == 200
            time.sleep(0.3)
        lines = [record for record in caplog.records if "Avg prompt throughput" in record.getMessage()]
        assert bool(lines) is not disabled
        assert all(record.levelno == logging.INFO for record in lines)


def test_stats_lines_of_idle_intervals_are_debug(engine):
    stats = engine.stats()
    logger = StatsLogger(None, 10.0, NAME)
    logger._last, logger._last_time = stats, 0.0
    busy = replace(stats, prompt_tokens=stats.prompt_tokens + 50, generation_tokens=stats.generation_tokens + 10)
    level, line = logger.line(busy, 10.0)
    assert level == logging.INFO and "Avg prompt throughput: 5.0 tokens/s" in line and "generation throughput: 1.0" in line
    assert logger.line(busy, 20.0)[0] == logging.INFO  # the interval after activity still says it went quiet
    assert logger.line(busy, 30.0)[0] == logging.DEBUG  # idle since: quiet at INFO


def test_the_tgi_shard_loads_remote_code_only_when_trusted(remote_model):
    """TGI's `--trust-remote-code` reaches the shard's loader (its router passes it on) as the engine's does."""
    from paged_backend.tgi.shard.model import ShardModel

    with pytest.raises(InvalidRequest, match="--trust-remote-code"):
        ShardModel(str(remote_model), device="cpu", num_blocks=16)
    shard = ShardModel(str(remote_model), device="cpu", num_blocks=16, trust_remote_code=True)
    assert type(shard.model).__name__ == "RemoteLlamaForCausalLM"
