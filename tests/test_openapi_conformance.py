"""/openapi.json tells the truth: schemathesis' `st run --checks all` finds no disagreement with the live server.

Every check runs (server errors, undocumented statuses and content types, response schemas, `Allow` on 405,
invalid bodies rejected, ...). One is narrowed, with the reason: a generation body can be schema-valid and still
be refused with a 400 by rules a JSON schema cannot state, because they relate fields to each other or to the
served model (prompt plus max_tokens within the context, token ids within the vocabulary, best_of >= n,
min_tokens <= max_tokens, one output constraint at a time, a regex or grammar that compiles, message shapes that
depend on the role). So for POST operations a 400 counts as an accepted answer to schema-valid data, as long as it
does not come from the body's own type and range validation (`tests/_schemathesis_hooks.py` checks that); every
constraint a schema can state is declared (`test_the_document_declares_what_the_server_enforces`).

`assert_conforms(base_url)` is reusable: the TGI face's test can call it with its own server's address.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from tests._server_helpers import API_KEY, server_fixture

REPOSITORY = Path(__file__).resolve().parents[1]
MAX_EXAMPLES = 15  # per operation and phase
SCHEMATHESIS_CONFIG = """
[[operations]]
include-method = "POST"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "404", "413", "429"]
"""


def assert_conforms(base_url: str, tmp_path: Path, *, headers: dict[str, str] | None = None,
                    max_examples: int = MAX_EXAMPLES, config: str = SCHEMATHESIS_CONFIG) -> None:  # fmt: skip
    """Run `st run --checks all` against `base_url`/openapi.json and fail with its report if it finds anything."""
    config_file = tmp_path / "schemathesis.toml"
    config_file.write_text(config)
    command = [str(Path(sys.executable).with_name("st")), "--config-file", str(config_file), "--no-color", "run",
               f"{base_url}/openapi.json", "--checks", "all", "--max-examples", str(max_examples),
               "--phases", "examples,coverage,fuzzing", "--workers", "1", "--seed", "1",
               "--generation-database", "none", "--request-timeout", "60"]  # fmt: skip
    for name, value in (headers or {}).items():
        command += ["--header", f"{name}: {value}"]
    hooks = {"SCHEMATHESIS_HOOKS": "tests._schemathesis_hooks", "PYTHONPATH": str(REPOSITORY)}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                            env={**os.environ, **hooks})  # fmt: skip
    assert result.returncode == 0, f"schemathesis found disagreements:\n{result.stdout[-20000:]}\n{result.stderr}"


FILES_DIR = tempfile.mkdtemp(prefix="paged-backend-conformance-")  # the uploads schemathesis makes land here
atexit.register(shutil.rmtree, FILES_DIR, ignore_errors=True)
server = server_fixture("--num-blocks", "64", "--max-model-len", "64", "--files-dir", FILES_DIR)


def test_schemathesis_checks_all_pass(server, tmp_path):
    assert_conforms(server.url, tmp_path, headers={"Authorization": f"Bearer {API_KEY}"})
    server.wait_until_drained()


def test_the_document_declares_what_the_server_enforces(server):
    document = httpx.get(f"{server.url}/openapi.json").json()
    completions = document["paths"]["/v1/completions"]["post"]
    assert "422" not in completions["responses"]
    error = completions["responses"]["400"]["content"]["application/json"]["schema"]
    assert error == {"$ref": "#/components/schemas/ErrorResponse"}
    assert "text/event-stream" in completions["responses"]["200"]["content"]
    prompt_forms = document["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert {"type": "string", "minLength": 1} in prompt_forms  # an empty prompt is refused, so it is declared
    metrics = document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    assert "HTTPValidationError" not in document["components"]["schemas"]


def test_a_wrong_method_names_the_allowed_ones(server):
    response = httpx.request("TRACE", f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 405 and response.headers["Allow"] == "POST"
