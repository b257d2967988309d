"""A live `serve` and a live `launch`, scraped by a real Prometheus with the exported scrape config: every
dashboard panel's PromQL answers with data, and the counters agree with the traffic this test sent.

Prometheus is Debian's `prometheus` package (`.ci/setup` installs it); without it the test skips, except in
CI, where a missing Prometheus fails.
"""

from __future__ import annotations

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

from paged_backend.dashboards import DASHBOARDS, dashboard, export, panel_queries
from paged_backend.dashboards.render import promql, render
from tests._server_helpers import API_KEY, MODEL, running_server
from tests._tgi_helpers import TgiServer, free_port

SCRAPE_INTERVAL = "1s"
WINDOW = "2m"  # stands in for $__rate_interval / $__range: the whole test fits in it
SERVE_REQUESTS = [list(range(3, 40)), list(range(3, 40)), [7, 8, 9], list(range(50, 70))]  # a repeat: prefix hits
TGI_PROMPTS = ["Hello world", "The quick brown fox", "paged"]
MAX_TOKENS = 6


def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail("Debian's prometheus is missing in CI: .ci/setup should have installed it")
        pytest.skip("Debian's `prometheus` package is not installed (apt-get install prometheus; .ci/setup does it)")
    return path


@pytest.fixture(scope="module")
def faces():
    """`python -m paged_backend.server` and `python -m paged_backend.tgi` (launch), started side by side."""
    with ExitStack() as stack:
        launch = TgiServer("paged")
        stack.callback(launch.stop)
        serve = stack.enter_context(
            running_server("--enable-prefix-caching", "--num-blocks", "256", "--block-size", "16")
        )
        launch.wait_ready()
        yield serve, launch


class Prometheus:
    def __init__(self, config: Path, directory: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [f"--config.file={config}", f"--storage.tsdb.path={directory / 'data'}", "--log.level=warn",
                f"--web.listen-address=127.0.0.1:{self.port}"]  # fmt: skip
        self.log = tempfile.TemporaryFile("w+")
        self.popen = subprocess.Popen([prometheus_binary(), *args], stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.popen.poll() is None, self.output()
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"prometheus not ready:\n{self.output()}")

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
    serve, launch = faces
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
        prometheus.wait_for("sum(paged_backend:request_success_total)", counters_before[SERVE_COUNTERS[0]] + sent[0])
        prometheus.wait_for("tgi_request_success", counters_before[TGI_COUNTERS[1]] + sent[3])
        time.sleep(1.5)  # a few more scrapes after the traffic: gauges back at idle, rate windows closed

        for expression, expected in zip(SERVE_COUNTERS + TGI_COUNTERS, expected_counts(sent), strict=True):
            assert prometheus.counter(expression) - counters_before[expression] == expected, expression

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
        if os.environ.get("PAGED_BACKEND_DASHBOARD_PNG"):  # how the README's figure was made
            render("serve", os.environ["PAGED_BACKEND_DASHBOARD_PNG"], prometheus.url, started, time.time(), WINDOW)
    finally:
        prometheus.stop()


SERVE_COUNTERS = [
    "paged_backend:request_success_total",
    "paged_backend:prompt_tokens_total",
    "paged_backend:generation_tokens_total",
    "paged_backend:e2e_request_latency_seconds_count",
    "paged_backend:time_to_first_token_seconds_count",
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
        body = dict(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
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
