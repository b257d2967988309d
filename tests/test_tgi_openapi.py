"""Schemathesis (`st run --checks all`) against a live `paged-backend launch --backend paged`: the document is true.

Every check runs: no 5xx, only documented statuses, media types and headers, responses matching their schemas,
405s naming every allowed method, schema-violating bodies refused, schema-valid bodies accepted. The one allowance
is the one schemathesis documents for rules a schema cannot express: a 422 for a schema-valid body on the routes
with cross-field rules (the token budget, best_of with sampling, a grammar that compiles, tools naming a function).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests._tgi_helpers import TgiServer, running

ST = Path(sys.executable).with_name("st")
CROSS_FIELD_ROUTES = [
    "POST /generate",
    "POST /generate_stream",
    "POST /",
    "POST /v1/chat/completions",
    "POST /v1/completions",
    "POST /chat_tokenize",
    "POST /invocations",
]
# Short outputs keep each generated request fast; the limits still come from the launcher's flags.
LAUNCH_ARGS = ["--max-total-tokens", "48", "--max-input-tokens", "40", "--max-concurrent-requests", "64"]


def schemathesis_config() -> str:
    sections = [
        "[[operations]]\n"
        f'include-name = "{name}"\n'
        'checks.positive_data_acceptance.expected-statuses = ["2xx", "3xx", "401", "403", "404", "409", "429", '
        '"5xx", "422"]\n'
        for name in CROSS_FIELD_ROUTES
    ]
    return "\n".join(sections)


@pytest.fixture(scope="module")
def server():
    with running(TgiServer("paged", LAUNCH_ARGS)) as (launched,):
        yield launched


@pytest.mark.timeout(240)
def test_schemathesis_finds_no_disagreement_between_document_and_server(server, tmp_path):
    config = tmp_path / "schemathesis.toml"
    config.write_text(schemathesis_config())
    command = [
        str(ST), "--config-file", str(config), "--no-color", "run", f"{server.url}/openapi.json",
        "--checks", "all", "--max-examples", "8", "--max-time", "30", "--workers", "2", "--seed", "7",
        "--generation-database", "none", "--request-timeout", "30", "--max-response-time", "30",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=200, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-12000:] + result.stderr[-2000:]
    assert "14/14" in result.stdout  # every operation was exercised
    server.wait_until_drained()


def test_document_declares_the_served_shapes(server):
    document = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    paths = document["paths"]
    assert "text/plain" in paths["/metrics"]["get"]["responses"]["200"]["content"]
    assert "text/event-stream" in paths["/generate_stream"]["post"]["responses"]["200"]["content"]
    assert "content" not in paths["/health"]["get"]["responses"]["200"]  # an empty body
    parameters = document["components"]["schemas"]["GenerateParameters"]["properties"]
    max_new_tokens = next(option for option in parameters["max_new_tokens"]["anyOf"] if option["type"] == "integer")
    assert max_new_tokens["maximum"] == 47 and max_new_tokens["minimum"] == 1
    inputs = document["components"]["schemas"]["GenerateRequest"]["properties"]["inputs"]
    assert inputs["minLength"] == 1
    error = paths["/generate"]["post"]["responses"]["422"]["content"]["application/json"]["schema"]
    assert error == {"$ref": "#/components/schemas/ErrorResponse"}


def test_405_lists_every_method_of_the_path(server):
    response = httpx.request("PUT", f"{server.url}/", timeout=30)
    assert response.status_code == 405
    assert set(response.headers["allow"].split(", ")) == {"GET", "POST"}
    assert response.json()["error_type"] == "http"


def test_malformed_json_is_400_and_a_body_out_of_shape_is_422(server):
    broken = httpx.post(f"{server.url}/generate", content=b"{", headers={"content-type": "application/json"})
    assert broken.status_code == 400 and broken.json()["error"].startswith("Failed to parse the request body as JSON")
    wrong_type = httpx.post(f"{server.url}/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": "3"}})
    assert wrong_type.status_code == 422 and "max_new_tokens" in wrong_type.json()["error"]
    whole_float = httpx.post(f"{server.url}/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2.0}})
    assert whole_float.status_code == 200  # JSON Schema counts 2.0 as an integer, so the server does too
