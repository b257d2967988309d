"""Several models: config files (YAML, TOML) and repeated flags become model specs; one KV budget is split by
shares; the `--lora-modules` flag forms. The served behaviour is in test_tenants_server.py."""

from __future__ import annotations

import pytest

from paged_backend.config import EngineConfig
from paged_backend.errors import InvalidRequest
from paged_backend.lora.request import parse_lora_modules
from paged_backend.server.multi_model import build_engines, model_specs
from paged_backend.worker.default_model import TINY_MODEL


def test_a_config_file_lists_models_with_options_and_shares(tmp_path):
    yaml_file, toml_file = tmp_path / "models.yaml", tmp_path / "models.toml"
    yaml_file.write_text("models:\n  - {model: null, served_model_name: a, share: 3, max_num_seqs: 8}\n"
                         "  - {model: null, served_model_name: b}\n")  # fmt: skip
    toml_file.write_text('[[models]]\nserved_model_name = "a"\nshare = 3\nmax_num_seqs = 8\n'
                         '[[models]]\nserved_model_name = "b"\n')  # fmt: skip
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
