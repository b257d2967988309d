"""A live `serve` and a live `launch`, scraped by a real Prometheus with the exported scrape config: every
dashboard panel's PromQL answers with data, and the counters agree with the traffic this test sent. The same
two processes export request spans to a real OTLP receiver, and `bench serve` measures both.

Prometheus is Debian's `prometheus` package (`.ci/setup` installs it); without it the test skips, except in
CI, where a missing Prometheus fails.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from paged_backend.observability.dashboards import DASHBOARDS, dashboard, export, panel_queries
from paged_backend.observability.dashboards.render import promql, render
from paged_backend.worker.default_model import TINY_MODEL
from tests._otlp_receiver import otlp_receiver
from tests._server_helpers import API_KEY, running_server, wait_for_ok
from tests._tgi_helpers import TgiServer, free_port

SCRAPE_INTERVAL = "1s"
WINDOW = "2m"  # stands in for $__rate_interval / $__range: the whole test fits in it
SERVE_REQUESTS = [list(range(3, 40)), list(range(3, 40)), [7, 8, 9], list(range(50, 70))]  # a repeat: prefix hits
TGI_PROMPTS = ["Hello world", "The quick brown fox", "paged"]
MAX_TOKENS = 6
SERVE_NAME = "tiny-serve"  # the tiny model under its own name on serve, so the two faces' spans tell apart


def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail("Debian's prometheus is missing in CI: .ci/setup should have installed it")
        pytest.skip("Debian's `prometheus` package is not installed (apt-get install prometheus; .ci/setup does it)")
    return path


OTLP_ENV = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "100"}


@pytest.fixture(scope="module")
def faces():
    """`python -m paged_backend.server` and `python -m paged_backend.tgi` (launch), started side by side, sending
    their spans to a real OTLP receiver where oteltap is installed (the receiver is None otherwise)."""
    with ExitStack() as stack:
        receiver = stack.enter_context(otlp_receiver())
        launch_flags = ["--otlp-endpoint", receiver.endpoint] if receiver else []
        launch = TgiServer("paged", launch_flags, env=OTLP_ENV)
        stack.callback(launch.stop)
        serve_flags = ["--otlp-traces-endpoint", receiver.endpoint] if receiver else []
        with pytest.MonkeyPatch.context() as env:
            for name, value in OTLP_ENV.items():
                env.setenv(name, value)
            serve = stack.enter_context(
                running_server("--enable-prefix-caching", "--num-blocks", "256", "--block-size", "16",
                               "--served-model-name", SERVE_NAME, *serve_flags)
            )
        launch.wait_ready()
        yield serve, launch, receiver


class Prometheus:
    def __init__(self, config: Path, directory: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [f"--config.file={config}", f"--storage.tsdb.path={directory / 'data'}", "--log.level=warn",
                f"--web.listen-address=127.0.0.1:{self.port}"]  # fmt: skip
        self.log = tempfile.TemporaryFile("w+")
        self.popen = subprocess.Popen([prometheus_binary(), *args], stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 60) -> None:
        wait_for_ok(f"{self.url}/-/ready", self.popen, self.output, timeout)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        self.popen.terminate()
        self.popen.wait(30)
        self.log.close()

    def query(self, expression: str) -> list[dict]:
        response = httpx.get(f"{self.url}/api/v1/query", params={"query": expression}, timeout=30)
        body = response.json()
        assert response.status_code == 200 and body["status"] == "success", (expression, body)
        return body["data"]["result"]

    def value(self, expression: str) -> float:
        result = self.query(expression)
        assert len(result) == 1, (expression, result)
        return float(result[0]["value"][1])

    def counter(self, expression: str) -> float:
        """A counter summed over its series; 0 before any series exists (a labelled counter never incremented)."""
        return self.value(f"sum({expression}) or vector(0)")

    def wait_for(self, expression: str, expected: float, timeout: float = 30) -> None:
        """Until a scrape has seen `expected` (so the traffic's counts are in the TSDB)."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expression)
            if result and float(result[0]["value"][1]) == expected:
                return
            assert time.monotonic() < deadline, f"{expression} stayed {result}, expected {expected}"
            time.sleep(0.25)


def scrape_config(exported: Path, serve_url: str, launch_url: str) -> str:
    """The exported config, pointed at the live servers and scraping every second."""
    config = yaml.safe_load(exported.read_text())
    config["global"].update(scrape_interval=SCRAPE_INTERVAL, evaluation_interval=SCRAPE_INTERVAL)
    targets = {"paged-backend-serve": serve_url, "paged-backend-tgi": launch_url}
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": [targets[job["job_name"]].removeprefix("http://")]}]
    return yaml.safe_dump(config)


def test_every_panel_answers_and_counters_match_traffic(faces, tmp_path):
    serve, launch, _ = faces
    files = export(tmp_path / "export")
    assert {path.relative_to(tmp_path / "export").as_posix() for path in files} >= {
        "prometheus.yml",
        "grafana/dashboards/paged-backend-serve.json",
        "grafana/dashboards/paged-backend-tgi.json",
    }
    promtool = shutil.which("promtool") or pytest.fail("promtool ships with prometheus but is missing")
    config = tmp_path / "prometheus.yml"
    config.write_text(scrape_config(tmp_path / "export" / "prometheus.yml", serve.url, launch.url))
    for path in (tmp_path / "export" / "prometheus.yml", config):
        checked = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True)
        assert checked.returncode == 0, checked.stdout + checked.stderr

    prometheus = Prometheus(config, tmp_path)
    try:
        prometheus.wait_ready()
        started = time.time()
        # A scrape before the traffic, so every rate() in the window sees the counters rise.
        prometheus.wait_for('count(up{job=~"paged-backend-.*"} == 1)', 2)
        counters_before = {expr: prometheus.counter(expr) for expr in SERVE_COUNTERS + TGI_COUNTERS}
        sent = send_traffic(serve, launch)
        prometheus.wait_for(f"sum(paged_backend:request_success_total{SERVE})", counters_before[SERVE_COUNTERS[0]] + sent[0])
        prometheus.wait_for("tgi_request_success", counters_before[TGI_COUNTERS[1]] + sent[3])
        time.sleep(1.5)  # a few more scrapes after the traffic: gauges back at idle, rate windows closed

        for expression, expected in zip(SERVE_COUNTERS + TGI_COUNTERS, expected_counts(sent), strict=True):
            assert prometheus.counter(expression) - counters_before[expression] == expected, expression

        for expression in SERVE_COUNTERS:  # the same counts under vLLM's names, as its dashboards select them
            vllm = expression.replace("paged_backend:", "vllm:").replace("{", f'{{model_name="{SERVE_NAME}",')
            assert prometheus.counter(vllm) == prometheus.counter(expression), vllm
        for expression in VLLM_PANELS:
            [series] = prometheus.query(promql(expression, WINDOW))
            assert math.isfinite(float(series["value"][1])), (expression, series)
        assert prometheus.value(f'vllm:num_requests_running{{model_name="{SERVE_NAME}"}}') == 0
        for face in DASHBOARDS:
            for title, legend, expression in panel_queries(dashboard(face)):
                result = prometheus.query(promql(expression, WINDOW))
                assert result, f"{face} panel {title!r} ({legend}) returned no data: {expression}"
                for series in result:
                    assert math.isfinite(float(series["value"][1])), f"{face} panel {title!r} ({legend}): {series}"
        instances = httpx.get(f"{prometheus.url}/api/v1/label/instance/values", timeout=10).json()["data"]
        assert {serve.url.removeprefix("http://"), launch.url.removeprefix("http://")} <= set(instances)
        hit_rate = prometheus.value(promql(panel_queries(dashboard("serve"))[4][2], WINDOW))
        assert 0 < hit_rate < 1  # the repeated prompt hit the prefix cache
        picture = render("serve", tmp_path / "serve.png", prometheus.url, started, time.time(), WINDOW)
        assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        if os.environ.get("PAGED_BACKEND_DASHBOARD_PNG"):  # how docs/operations.md's figure was made
            render("serve", os.environ["PAGED_BACKEND_DASHBOARD_PNG"], prometheus.url, started, time.time(), WINDOW)
    finally:
        prometheus.stop()


SERVE = '{job="paged-backend-serve"}'  # the TGI face (paged backend) exports the engine's counters too
SERVE_COUNTERS = [
    f"paged_backend:request_success_total{SERVE}",
    f"paged_backend:prompt_tokens_total{SERVE}",
    f"paged_backend:generation_tokens_total{SERVE}",
    f"paged_backend:e2e_request_latency_seconds_count{SERVE}",
    f"paged_backend:time_to_first_token_seconds_count{SERVE}",
]
_MODEL = f'model_name="{SERVE_NAME}"'
VLLM_PANELS = [  # written as vLLM's own Grafana dashboard writes its panels, against vLLM's names
    f"histogram_quantile(0.99, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{{{_MODEL}}}[$__rate_interval])))",
    f"histogram_quantile(0.5, sum by(le) (rate(vllm:inter_token_latency_seconds_bucket{{{_MODEL}}}[$__rate_interval])))",
    f"rate(vllm:e2e_request_latency_seconds_sum{{{_MODEL}}}[$__rate_interval]) / "
    f"rate(vllm:e2e_request_latency_seconds_count{{{_MODEL}}}[$__rate_interval])",
    f"sum(rate(vllm:request_prompt_tokens_sum{{{_MODEL}}}[$__rate_interval]))",
    f"sum(increase(vllm:iteration_tokens_total_count{{{_MODEL}}}[$__range]))",
    f"sum(vllm:kv_cache_usage_perc{{{_MODEL}}})",
]
TGI_COUNTERS = [
    "tgi_request_count",
    "tgi_request_success",
    "tgi_request_input_length_sum",
    "tgi_request_generated_tokens_sum",
    "tgi_request_duration_count",
]


def expected_counts(sent: tuple[int, int, int, int, int, int]) -> list[float]:
    serve_requests, serve_prompt, serve_generated, tgi_requests, tgi_prompt, tgi_generated = sent
    return [serve_requests, serve_prompt, serve_generated, serve_requests, serve_requests,
            tgi_requests, tgi_requests, tgi_prompt, tgi_generated, tgi_requests]  # fmt: skip


def send_traffic(serve, launch) -> tuple[int, int, int, int, int, int]:
    """Completions (half streamed) on serve and /generate on launch; what each server reported it did."""
    client = openai.OpenAI(base_url=f"{serve.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    prompt_tokens = generated = 0
    for index, prompt in enumerate(SERVE_REQUESTS):
        body = dict(model=SERVE_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
        if index % 2:
            chunks = list(client.completions.create(**body, stream=True, stream_options={"include_usage": True}))
            usage = chunks[-1].usage
        else:
            usage = client.completions.create(**body).usage
        prompt_tokens += usage.prompt_tokens
        generated += usage.completion_tokens
    assert prompt_tokens == sum(map(len, SERVE_REQUESTS)) and generated == MAX_TOKENS * len(SERVE_REQUESTS)
    tgi_prompt = tgi_generated = 0
    for prompt in TGI_PROMPTS:
        response = httpx.post(f"{launch.url}/generate", timeout=60,
                              json={"inputs": prompt, "parameters": {"max_new_tokens": MAX_TOKENS}})  # fmt: skip
        assert response.status_code == 200, response.text
        tgi_prompt += int(response.headers["x-prompt-tokens"])
        tgi_generated += int(response.headers["x-generated-tokens"])
    return len(SERVE_REQUESTS), prompt_tokens, generated, len(TGI_PROMPTS), tgi_prompt, tgi_generated


@pytest.mark.parametrize("face", ["serve", "launch"])
def test_bench_serve_against_a_live_server(faces, face, tmp_path, capsys):
    """`paged-backend bench serve` against serve's /v1 and launch's TGI /v1: table, JSON and PNG."""
    from paged_backend.bench.serve import main

    server = dict(zip(("serve", "launch"), faces[:2], strict=True))[face]
    json_path, png_path = tmp_path / "serve.json", tmp_path / "serve.png"
    summaries = main(["--base-url", server.url, "--api-key", API_KEY, "--num-prompts", "4", "--request-rate", "inf,8",
                      "--max-concurrency", "2", "--random-input-len", "6", "--random-output-len", "4",
                      "--goodput", "ttft:60000", "tpot:60000", "--output-json", str(json_path), "--plot", str(png_path)])  # fmt: skip
    assert [s.completed for s in summaries] == [4, 4] and all(s.failed == 0 for s in summaries)
    assert all(s.goodput == pytest.approx(s.request_throughput) for s in summaries)  # generous SLOs: all good
    written = json.loads(json_path.read_text())
    assert [r["request_rate"] for r in written["results"]] == [math.inf, 8.0]
    assert set(written["results"][0]["latency_ms"]) == {"ttft", "tpot", "itl", "e2el"}
    assert written["results"][0]["latency_ms"]["ttft"]["p99"] > 0
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out
    assert "| rate (req/s) | concurrency | done | failed | req/s | out tok/s | goodput (req/s) |" in table


def test_both_faces_export_spans_to_a_real_otlp_receiver(faces):
    """`serve --otlp-traces-endpoint` and `launch --otlp-endpoint`, as started from the command line, send one
    `llm_request` span per request over OTLP/HTTP, as children of the client's `traceparent`."""
    serve, launch, receiver = faces
    if receiver is None:
        pytest.skip("the oteltap OTLP receiver is not installed (pip install oteltap; the test extra has it)")
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    headers = {"traceparent": f"00-{trace_id}-{parent_id}-01"}
    client = openai.OpenAI(base_url=f"{serve.url}/v1", api_key=API_KEY, max_retries=0, default_headers=headers)
    client.completions.create(model=SERVE_NAME, prompt=[4, 5, 6], max_tokens=3, extra_body={"ignore_eos": True})
    response = httpx.post(f"{launch.url}/generate", headers=headers, timeout=60,
                          json={"inputs": "Hello", "parameters": {"max_new_tokens": 3}})  # fmt: skip
    assert response.status_code == 200, response.text
    spans = receiver.wait_for(lambda span: span.trace_id.hex() == trace_id, 2)
    assert len(spans) == 2
    for span in spans:
        attributes = {a.key: a.value for a in span.attributes}
        assert span.name == "llm_request" and span.parent_span_id.hex() == parent_id
        assert attributes["gen_ai.usage.completion_tokens"].int_value == 3
        assert attributes["gen_ai.latency.e2e"].double_value > 0
    models = {next(a.value.string_value for a in s.attributes if a.key == "gen_ai.response.model") for s in spans}
    assert models == {SERVE_NAME, TINY_MODEL}  # one span from each face
