"""The KV map: the cells drawn match the block manager's stats(), group by group; the server route is opt-in."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
import torch
from _hf_models import tiny_model
from _http_stub import answering
from _server_helpers import API_KEY, MODEL, running_server
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from paged_backend import cli
from paged_backend.engine import LLM, Engine, SamplingParams, engine_config
from paged_backend.hf import PagedCache
from paged_backend.server.app import build_app
from paged_backend.server.state import ServerSettings
from paged_backend.worker.default_model import TINY_MODEL
from paged_backend.worker.models import byte_tokenizer

pytest.importorskip("matplotlib")


def assert_cells_match_stats(drawing, stats) -> None:
    groups = stats.groups
    assert len(drawing.cells) == len(groups)
    for cells, group in zip(drawing.cells, groups, strict=True):
        assert cells["owned"] + cells["shared"] == group.used_blocks
        assert cells["shared"] == group.shared_blocks
        assert cells["cached"] == group.cached_blocks
        assert cells["free"] == stats.free_blocks
        assert sum(cells.values()) == stats.total_blocks  # every usable block once per panel
    assert drawing.swapped_cells == stats.cpu_blocks_used
    assert drawing.png.stat().st_size > 0 and "data:image/png;base64," in drawing.html.read_text()


def test_engine_map_with_parallel_samples_prefix_hits_and_swaps_matches_stats(tmp_path):
    torch.set_num_threads(1)
    llm = LLM(tiny_model("gemma3", seed=3), tokenizer=byte_tokenizer(), num_blocks=40, block_size=4,
              swap_space=0.001, preemption_mode="swap")  # fmt: skip
    engine: Engine = llm.engine
    shared = list(range(3, 30))
    llm.generate([shared + [5]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # publish a prefix
    long = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=24, ignore_eos=True)
    for index in range(3):
        engine.add_request(str(index), None, long, prompt_token_ids=shared + [7 + index])
    swapped_seen = False
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.block_manager.stats()
        if stats.cpu_blocks_used and not swapped_seen or engine.stats().num_steps == 4:
            swapped_seen = swapped_seen or bool(stats.cpu_blocks_used)
            assert_cells_match_stats(llm.kv_map(tmp_path / f"step{engine.stats().num_steps}.png"), stats)
    assert swapped_seen and engine.stats().prefix_cache_hits > 0
    drawing = llm.kv_map(tmp_path / "done.png")  # all finished: nothing held, cached prefixes remain
    assert_cells_match_stats(drawing, engine.block_manager.stats())
    assert all(cells["owned"] == cells["shared"] == 0 for cells in drawing.cells)


def test_paged_cache_map_matches_stats(tmp_path):
    model = tiny_model("mistral")
    cache = PagedCache(model, num_blocks=64, block_size=4)
    ids = torch.tensor([list(range(3, 20))])
    model.generate(ids, max_new_tokens=10, do_sample=False, num_beams=2, past_key_values=cache)
    drawing = cache.kv_map(tmp_path / "cache.png")
    assert_cells_match_stats(drawing, cache.stats().blocks)
    assert drawing.cells[0]["owned"] + drawing.cells[0]["shared"] > 0
    cache.reset()


def test_debug_route_is_off_by_default():
    engine = Engine(engine_config(model=TINY_MODEL, device="cpu", num_blocks=16))
    with TestClient(build_app(engine, ServerSettings())) as client:
        assert client.get("/debug/kv").status_code == 404
    with TestClient(build_app(engine, ServerSettings(enable_debug_routes=True))) as client:
        snapshot = client.get("/debug/kv").json()
    assert len(snapshot["blocks"]) == snapshot["stats"]["total_blocks"] == 15


def test_kv_map_command_draws_a_running_server(tmp_path):
    with running_server("--enable-debug-routes", "--num-blocks", "96", "--block-size", "4") as server:
        client = server.client()
        streaming, stop = threading.Event(), threading.Event()

        def long_request():  # n=2 siblings share the prompt's blocks; leaving the stream early aborts it
            stream = client.completions.create(model=MODEL, prompt="a shared system prompt, " * 2, max_tokens=300,
                                               n=2, stream=True, extra_body={"ignore_eos": True})  # fmt: skip
            for _ in stream:
                streaming.set()
                if stop.is_set():
                    break
            stream.close()

        worker = threading.Thread(target=long_request)
        worker.start()
        assert streaming.wait(60)
        output = tmp_path / "server.png"
        done = CliRunner().invoke(
            cli.app, ["kv-map", "--url", server.url, "--output", str(output), "--api-key", API_KEY]
        )
        stop.set()
        worker.join(60)
        assert done.exit_code == 0, done.output
        assert output.exists() and output.with_suffix(".html").exists()
        snapshot = httpx.get(f"{server.url}/debug/kv", headers={"Authorization": f"Bearer {API_KEY}"}).json()
        assert snapshot["history"] and {b["state"] for b in snapshot["blocks"]} <= {"owned", "shared", "cached", "free"}
        assert httpx.get(f"{server.url}/debug/kv").status_code == 401  # it names every request: the key's alone
        base_url = CliRunner().invoke(  # an OpenAI client's base URL names the same server
            cli.app, ["kv-map", "--url", f"{server.url}/v1", "--output", str(output), "--api-key", API_KEY]
        )
        assert base_url.exit_code == 0, base_url.output
        keyless = kv_map_command("--url", server.url, "--output", str(tmp_path / "keyless.png"))
        assert keyless.exit_code == 2 and "answered 401; pass the server's key with --api-key" in keyless.output


def kv_map_command(*args: str):
    return CliRunner().invoke(cli.app, ["kv-map", *args])


def one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert result.output.startswith("error: "), result.output
    return result.output.strip()


def test_kv_map_command_refuses_an_unwritable_format_before_fetching(tmp_path):
    fetched: list[str] = []
    with answering(500, asked=fetched) as url:
        error = one_line_error(kv_map_command("--url", url, "--output", str(tmp_path / "out.txt")))
    assert error.startswith(f"error: --output {tmp_path / 'out.txt'}: matplotlib cannot write a .txt picture")
    assert ".png" in error and ".svg" in error and ".pdf" in error and fetched == []


@pytest.mark.parametrize("body", [json.dumps({"status": "ok"}), json.dumps([1, 2]), "<html>hello</html>"],
                         ids=["other-json", "a-list", "not-json"])  # fmt: skip
def test_kv_map_command_against_something_else_says_so(tmp_path, body):
    with answering(200, body.encode()) as url:
        error = one_line_error(kv_map_command("--url", url, "--output", str(tmp_path / "kv.png")))
    assert error.startswith(f"error: GET {url}/debug/kv did not answer the KV map's data") and "--url" in error
    assert "--enable-debug-routes" in error and not list(tmp_path.iterdir())


def snapshot_json() -> bytes:
    return json.dumps(Engine(engine_config(model=TINY_MODEL, device="cpu", num_blocks=16)).kv_snapshot()).encode()


def test_kv_map_command_names_the_files_it_writes(tmp_path):
    with answering(200, snapshot_json()) as url:
        done = kv_map_command("--url", url, "--output", str(tmp_path / "noext"))  # savefig adds .png
    assert done.exit_code == 0, done.output
    assert done.output.strip() == f"wrote {tmp_path / 'noext.png'} and {tmp_path / 'noext.html'}"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["noext.html", "noext.png"]


def test_kv_map_command_refuses_a_folder_as_output(tmp_path):
    folder = tmp_path / "maps"
    folder.mkdir()
    with answering(200, snapshot_json()) as url:
        error = one_line_error(kv_map_command("--url", url, "--output", str(folder)))
    assert error == f"error: --output {folder} is a folder; name the picture to write, e.g. {folder / 'kv_map.png'}"
    assert not list(folder.iterdir()) and not (tmp_path / "maps.png").exists()
