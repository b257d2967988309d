"""Speculative decoding through the faces: `serve --speculative-config` (openai client, Prometheus counters) and
`launch --speculate 2` (text-generation client) give the greedy tokens of plain decoding and free every block."""

from __future__ import annotations

import json
from contextlib import ExitStack

import pytest
from text_generation import Client

from paged_backend.engine import LLM, SamplingParams
from paged_backend.worker.default_model import TINY_MODEL
from tests._server_helpers import MODEL, running_server
from tests._tgi_helpers import TgiServer

CYCLIC = "abcdefg abcdefg abcdefg abcdefg "  # prompt lookup finds spans to copy
PROMPTS = [CYCLIC, "Hello world", CYCLIC + "abc"]
MAX_TOKENS = 16
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def faces():
    """Both faces start side by side (each imports torch), on the embedded tiny model."""
    with ExitStack() as stack:
        launch = TgiServer("paged", ["--speculate", "2"])
        stack.callback(launch.stop)
        serve = stack.enter_context(
            running_server("--num-blocks", "64", "--block-size", "4", "--speculative-config", json.dumps(NGRAM))
        )
        launch.wait_ready()
        yield serve, launch


@pytest.fixture(scope="module")
def plain():
    """Greedy tokens of plain decoding on the same embedded model, in this process."""
    llm = LLM(TINY_MODEL, device="cpu", num_blocks=64, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    return {
        prompt: (out.outputs[0].token_ids, out.outputs[0].text) for prompt, out in zip(PROMPTS, outputs, strict=True)
    }


def test_serve_speculates_and_matches_plain_decoding(faces, plain):
    serve, _ = faces
    before = serve.metrics()
    client = serve.client()
    for prompt in PROMPTS:
        completion = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
        )
        assert completion.choices[0].text == plain[prompt][1], prompt
    after = serve.wait_until_drained()
    drafted = "paged_backend:spec_decode_num_draft_tokens_total"
    assert after[drafted] > before.get(drafted, 0)
    assert after["paged_backend:spec_decode_num_accepted_tokens_total"] > 0
    assert any(name.startswith("paged_backend:spec_decode_num_accepted_tokens_per_pos") for name in after)


def test_launch_speculate_matches_plain_decoding(faces, plain):
    _, launch = faces
    before = launch.metrics()
    client = Client(launch.url, timeout=120)
    for prompt in PROMPTS:
        response = client.generate(prompt, max_new_tokens=MAX_TOKENS, decoder_input_details=False)
        tokens = [token.id for token in response.details.tokens]
        assert tokens == plain[prompt][0][: len(tokens)], prompt
        assert len(tokens) == MAX_TOKENS or response.details.finish_reason != "length"
    assert "ignoring --speculate" not in launch.output()
    after = launch.wait_until_drained()  # the engine's counters ride the TGI face's /metrics: speculation ran
    drafted = "paged_backend:spec_decode_num_draft_tokens_total"
    assert after[drafted] > before.get(drafted, 0)
    assert after["paged_backend:spec_decode_num_accepted_tokens_total"] > before.get(
        "paged_backend:spec_decode_num_accepted_tokens_total", 0
    )


def test_run_speculative_config_gives_plain_tokens_and_reports_acceptance(tmp_path, plain):
    from typer.testing import CliRunner

    from paged_backend.cli import app

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    args = ["run", "--model", TINY_MODEL, "--input", str(prompts), "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--no-progress",
            "--device", "cpu", "--num-blocks", "64", "--block-size", "4", "--speculative-config", json.dumps(NGRAM)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [row["outputs"][0]["token_ids"] for row in rows] == [plain[p][0] for p in PROMPTS]
    assert "draft tokens accepted" in result.stderr
