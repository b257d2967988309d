"""`paged-backend dashboards export / render` with bad input: one `error:` line naming what to change, exit 2, no
traceback. No Prometheus runs here: a port nothing listens on, or a tiny HTTP server answering something else."""

from __future__ import annotations

import json
import socket

import pytest
from _http_stub import answering
from typer.testing import CliRunner

from paged_backend.cli import app
from paged_backend.observability.dashboards import FILES

pytest.importorskip("matplotlib")


def one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output
    error = result.output.strip()
    assert error.startswith("error: "), result.output
    return error


def unused_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def render(tmp_path, prometheus: str, *flags: str):
    return CliRunner().invoke(
        app, ["dashboards", "render", "serve", str(tmp_path / "d.png"), "--prometheus", prometheus, *flags]
    )


def test_render_with_no_prometheus_listening_names_the_flag(tmp_path):
    url = unused_url()
    error = one_line_error(render(tmp_path, url))
    assert error.startswith(f"error: --prometheus {url}: cannot reach") and not (tmp_path / "d.png").exists()


def test_render_with_a_url_without_scheme_names_the_flag(tmp_path):
    error = one_line_error(render(tmp_path, "localhost:9090"))
    assert error.startswith("error: --prometheus 'localhost:9090' needs http:// or https://")


@pytest.mark.parametrize(
    ("status", "body", "said"),
    [
        (404, b"404 page not found", "answered 404"),
        (200, json.dumps({"status": "ok", "models": []}).encode(), "did not answer a Prometheus query_range result"),
        (200, b"<html>not json</html>", "did not answer a Prometheus query_range result"),
    ],
    ids=["404", "other-json", "not-json"],
)
def test_render_against_something_else_names_the_flag(tmp_path, status, body, said):
    with answering(status, body) as url:
        error = one_line_error(render(tmp_path, url))
    assert error.startswith(f"error: --prometheus {url}: GET {url}/api/v1/query_range") and said in error


def test_render_refused_query_names_the_window(tmp_path):
    refused = {"status": "error", "errorType": "bad_data", "error": 'parse error: bad duration syntax: "1"'}
    with answering(400, json.dumps(refused).encode()) as url:
        error = one_line_error(render(tmp_path, url, "--window", "1x"))
    assert error.startswith("error: --window '1x'") and "bad duration syntax" in error


@pytest.mark.parametrize("minutes", ["-5", "0"])
def test_render_refuses_non_positive_minutes_at_parse_time(tmp_path, minutes):
    result = render(tmp_path, unused_url(), "--minutes", minutes)
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "Invalid value for '--minutes': must be more than 0" in result.output


def test_export_into_an_existing_file_names_dir(tmp_path):
    existing = tmp_path / "passwd"
    existing.write_text("root:x:0:0\n")
    error = one_line_error(CliRunner().invoke(app, ["dashboards", "export", str(existing)]))
    assert error.startswith(f"error: DIR {existing} is a file") and existing.read_text() == "root:x:0:0\n"
    error = one_line_error(CliRunner().invoke(app, ["dashboards", "export", str(existing / "ops")]))
    assert error.startswith(f"error: DIR {existing / 'ops'}: cannot write there")


def test_export_writes_every_file(tmp_path):
    result = CliRunner().invoke(app, ["dashboards", "export", str(tmp_path / "ops")])
    assert result.exit_code == 0, result.output
    assert result.output.split() == [str(tmp_path / "ops" / path) for path in FILES]
