"""Several models: config files (YAML, TOML) and repeated flags become model specs; one KV budget is split by
shares; the `--lora-modules` flag forms; a models file's entries in vLLM's spellings (dashed keys, several served
names, the lora-modules forms) and each wrong entry refused in one line naming it and its key. The served
behaviour is in test_tenants_server.py."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from paged_backend.cli import app
from paged_backend.config import EngineConfig
from paged_backend.errors import InvalidRequest
from paged_backend.lora.request import parse_lora_modules
from paged_backend.server.multi_model import ModelSpec, build_engines, build_multi_model_app, model_specs, split_budget
from paged_backend.server.state import ServerSettings
from paged_backend.worker.default_model import TINY_MODEL

BASE = EngineConfig(model=None, device="cpu")


def test_a_config_file_lists_models_with_options_and_shares(tmp_path):
    yaml_file, toml_file = tmp_path / "models.yaml", tmp_path / "models.toml"
    yaml_file.write_text(f"models:\n  - {{model: {TINY_MODEL}, served_model_name: a, share: 3, max_num_seqs: 8}}\n"
                         f"  - {{model: {TINY_MODEL}, served_model_name: b}}\n")  # fmt: skip
    toml_file.write_text(f'[[models]]\nmodel = "{TINY_MODEL}"\nserved_model_name = "a"\nshare = 3\nmax_num_seqs = 8\n'
                         f'[[models]]\nmodel = "{TINY_MODEL}"\nserved_model_name = "b"\n')  # fmt: skip
    base = EngineConfig(model=TINY_MODEL, device="cpu", cache={"kv_cache_memory_bytes": 4 << 20})
    for path in (yaml_file, toml_file):
        specs = model_specs(base, [], [], str(path))
        assert [(s.name, s.share, s.config.scheduler.max_num_seqs) for s in specs] == [("a", 3, 8), ("b", 1, 256)]
    engines = build_engines(base, specs)  # one 4 MiB budget split 3:1 between two copies of the embedded model
    blocks = {name: engine.block_manager.num_blocks for name, engine in engines.items()}
    assert blocks["a"] == pytest.approx(3 * blocks["b"], rel=0.02)
    with pytest.raises(InvalidRequest, match="cannot read"):
        model_specs(base, [], [], str(tmp_path / "absent.yaml"))
    flags = model_specs(base, ["/m/a", "/m/b"], ["a", "b"], None)  # --model A --model B --served-model-name ...
    assert [(s.name, s.config.model, s.share) for s in flags] == [("a", "/m/a", 1.0), ("b", "/m/b", 1.0)]
    with pytest.raises(InvalidRequest, match="must differ"):
        model_specs(base, ["x", "y"], ["same", "same"], None)
    with pytest.raises(InvalidRequest, match="not both"):
        model_specs(base, ["x"], [], str(yaml_file))
    with pytest.raises(InvalidRequest, match="one per model"):
        model_specs(base, ["x", "y"], ["only-one"], None)


def test_lora_modules_flag_forms():
    assert parse_lora_modules(["sql=/a/sql", '{"name": "chat", "path": "/a/chat"}']) == {
        "sql": "/a/sql", "chat": "/a/chat"}  # fmt: skip
    for bad in ("no-equals", '{"name": "x"}'):
        with pytest.raises(InvalidRequest, match="--lora-modules"):
            parse_lora_modules([bad])


def specs_of(tmp_path, text: str, name: str = "models.yaml") -> list[ModelSpec]:
    path = tmp_path / name
    path.write_text(text)
    return model_specs(BASE, [], [], str(path))


def entry_error(tmp_path, entries: str) -> str:
    """The error of a models file with `entries` (YAML flow mappings, one a line), its path left out."""
    with pytest.raises(InvalidRequest) as raised:
        specs_of(tmp_path, "models:\n" + "".join(f"  - {entry}\n" for entry in entries.splitlines()))
    message = str(raised.value)
    assert "\n" not in message
    return message.removeprefix(f"{tmp_path / 'models.yaml'}: ")


def test_an_entry_takes_vllm_spellings_dashed_keys_and_flag_names(tmp_path):
    (spec,) = specs_of(tmp_path, "models:\n  - model: /m/a\n    served-model-name: a\n    max-model-len: 64\n"
                                 "    kv-cache-dtype: fp8\n    scheduling_policy: priority\n    max_num_seqs: null\n")
    config = spec.config
    assert (spec.name, config.model, config.scheduler.max_model_len) == ("a", "/m/a", 64)
    assert (config.cache.cache_dtype, config.scheduler.policy, config.scheduler.max_num_seqs) == ("fp8", "priority", 256)
    (toml,) = specs_of(tmp_path, '[[models]]\nmodel = "/m/a"\n"max-num-seqs" = 4\n', "models.toml")
    assert (toml.name, toml.config.scheduler.max_num_seqs) == ("/m/a", 4)  # no served name: the model as given


def test_an_entry_takes_lora_modules_in_the_flag_forms(tmp_path):
    listed = '[a=/x, {name: b, path: /y, base_model_name: m}, \'{"name": "c", "path": "/z"}\']'
    forms = {listed: {"a": "/x", "b": "/y", "c": "/z"}, "a=/x": {"a": "/x"}, "{name: b, path: /y}": {"b": "/y"},
             "{a: /x, b: /y}": {"a": "/x", "b": "/y"}, "[]": {}}  # fmt: skip
    for value, modules in forms.items():
        (spec,) = specs_of(tmp_path, f"models:\n  - {{model: /m/a, lora-modules: {value}}}\n")
        assert spec.config.lora_modules == modules, value
    for value in ("[no-equals]", "5", "[{name: x}]", "{a: 5}"):
        said = entry_error(tmp_path, f"{{model: /m/a, lora_modules: {value}}}")
        assert said.startswith("models[0]: `lora_modules`") and "name=path" in said, said


def test_several_served_names_alias_one_model(tmp_path):
    specs = specs_of(tmp_path, "models:\n  - {model: /m/a, served_model_name: [a, a-alias]}\n  - {model: /m/b}\n")
    assert [(s.name, s.aliases, s.config.model) for s in specs] == [("a", ("a-alias",), "/m/a"), ("/m/b", (), "/m/b")]
    with pytest.raises(InvalidRequest, match="must differ, got 'b' for several models"):
        specs_of(tmp_path, "models:\n  - {model: /m/a, served_model_name: [a, b]}\n"
                           "  - {model: /m/b, served_model_name: b}\n")  # fmt: skip
    for value in ("[]", "[a, 3]", "7"):
        said = entry_error(tmp_path, f"{{model: /m/a, served_model_name: {value}}}")
        assert said.startswith("models[0]: `served_model_name` must be a name or a non-empty list of names"), said


def test_served_aliases_route_to_their_model_and_are_listed(tmp_path):
    specs = specs_of(tmp_path, f"models:\n  - {{model: {TINY_MODEL}, served_model_name: [a, a2], num_blocks: 16}}\n"
                               f"  - {{model: {TINY_MODEL}, served_model_name: b, num_blocks: 16}}\n")  # fmt: skip
    aliases = {spec.name: spec.aliases for spec in specs}
    router = build_multi_model_app(build_engines(BASE, specs), ServerSettings(), aliases)
    with TestClient(router) as client:
        assert [card["id"] for card in client.get("/v1/models").json()["data"]] == ["a", "a2", "b"]
        answer = client.post("/v1/completions", json={"model": "a2", "prompt": "hi", "max_tokens": 1})
        assert answer.status_code == 200 and answer.json()["model"] == "a", answer.text
        missing = client.post("/v1/completions", json={"model": "c", "prompt": "hi", "max_tokens": 1})
        assert missing.status_code == 404 and "'a', 'a2', 'b'" in missing.text
        empty = client.post("/v1/completions", json={"model": "", "prompt": "hi", "max_tokens": 1})
        assert empty.status_code == 404 and "'a', 'a2', 'b'" in empty.text  # the first model's app named only its own
        deep = client.post("/v1/completions", content=b"[" * 100_000 + b"]" * 100_000,
                           headers={"Content-Type": "application/json"})  # fmt: skip
        assert deep.status_code == 400 and "nested too deeply" in deep.text  # the router read it as a 500


@pytest.mark.parametrize(
    ("entries", "said"),
    [
        ("{served_model_name: a}", "models[0]: no `model`; give the model to serve"),
        ("{model: /m/a}\n{model: null, served_model_name: b}", "models[1]: no `model`; give the model to serve"),
        ("{model: 5}", "models[0]: `model` must be a string, got 5"),
        ("{model: /m/a, share: abc}", "models[0]: `share` must be a positive number (its part of the KV budget), "
                                      "got 'abc'"),  # fmt: skip
        ("{model: /m/a, share: 0}", "models[0]: `share` must be a positive number"),
        ("{model: /m/a, share: -2}", "models[0]: `share` must be a positive number"),
        ("{model: /m/a, share: .inf}", "models[0]: `share` must be a positive number"),
        ("{model: /m/a, share: true}", "models[0]: `share` must be a positive number"),
        ("{model: /m/a, max_num_seq: 4}", "models[0]: unknown key `max_num_seq`; did you mean `max_num_seqs`?"),
        ("{model: /m/a, port: 8001}", "models[0]: unknown key `port`; an entry takes `model`, `served_model_name`"),
        ("{model: /m/a, max-num-seqs: lots}", "models[0]: `max-num-seqs`: Input should be a valid integer"),
        ("{model: /m/a, enable_lora: maybe}", "models[0]: `enable_lora`: Input should be a valid boolean"),
        ("{model: /m/a, block_size: 3}", "models[0]: `block_size`: block_size must be a power of two"),
        ("{model: /m/a, max_model_len: 8, max-model-len: 9}", "models[0]: `max_model_len` is given twice"),
        ("just-a-name", "models[0] is 'just-a-name'; each entry is a table with at least `model`"),
    ],
)
def test_a_wrong_entry_is_one_line_naming_it_and_its_key(tmp_path, entries, said):
    assert entry_error(tmp_path, entries).startswith(said)


def test_split_budget_refuses_a_share_that_is_not_positive():
    with pytest.raises(InvalidRequest, match="model 'a': `share` must be a positive number"):
        split_budget([ModelSpec("a", BASE, 0.0)], 1 << 20)


def test_serve_says_a_wrong_models_file_in_one_line_and_exits_2(tmp_path):
    path = tmp_path / "models.yaml"
    path.write_text("max-num-seqs: 4\nmodels:\n  - {model: /m/a}\n  - {model: /m/b, share: abc}\n")
    result = CliRunner().invoke(app, ["serve", "--config", str(path)])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert result.stderr.strip().splitlines() == [
        f"error: {path}: models[1]: `share` must be a positive number (its part of the KV budget), got 'abc'"]


def test_the_kv_map_of_each_model_is_asked_by_its_name(tmp_path):
    """A GET has no body to route by: /debug/kv?model=b is b's pool (it was always the first model's)."""
    specs = specs_of(tmp_path, f"models:\n  - {{model: {TINY_MODEL}, served_model_name: a, num_blocks: 16}}\n"
                               f"  - {{model: {TINY_MODEL}, served_model_name: b, num_blocks: 24}}\n")  # fmt: skip
    router = build_multi_model_app(build_engines(BASE, specs), ServerSettings(enable_debug_routes=True))
    with TestClient(router) as client:
        sizes = {name: len(client.get("/debug/kv", params={"model": name}).json()["blocks"]) for name in "ab"}
        assert sizes["b"] > sizes["a"], sizes
        assert client.get("/debug/kv", params={"model": "c"}).status_code == 404
