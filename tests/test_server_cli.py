"""`serve` flags: vLLM names, each mapped onto the EngineConfig field of the same name."""

from __future__ import annotations

import typer
from typer.testing import CliRunner

from paged_backend.config import EngineConfig
from paged_backend.engine.args import EngineArgs
from paged_backend.server.cli import register

ENGINE_FLAGS = ["--model", "--block-size", "--num-blocks", "--max-num-seqs", "--max-num-batched-tokens",
                "--max-model-len", "--swap-space", "--enable-prefix-caching", "--no-enable-prefix-caching",
                "--dtype", "--device", "--seed", "--gpu-memory-utilization", "--enforce-eager"]  # fmt: skip
SERVER_FLAGS = ["--host", "--port", "--api-key", "--max-concurrent-requests", "--max-request-body-bytes",
                "--strict-fields", "--enable-auto-tool-choice", "--tool-call-parser", "--chat-template",
                "--trust-request-chat-template"]  # fmt: skip


def test_every_flag_lands_on_its_config_field():
    args = EngineArgs(model="/models/x", block_size=8, num_blocks=99, max_num_seqs=4, max_num_batched_tokens=512,
                      max_model_len=256, swap_space=1.5, enable_prefix_caching=False, dtype="float32",
                      device="cpu", seed=3, gpu_memory_utilization=0.5, enforce_eager=True)  # fmt: skip
    config = args.to_engine_config()
    assert config.enforce_eager
    assert (config.model, config.dtype, config.device, config.seed) == ("/models/x", "float32", "cpu", 3)
    assert (config.cache.block_size, config.cache.num_blocks, config.cache.swap_space) == (8, 99, 1.5)
    assert (config.cache.enable_prefix_caching, config.cache.gpu_memory_utilization) == (False, 0.5)
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (4, 512)
    assert config.scheduler.max_model_len == 256


def test_flags_left_out_keep_the_config_defaults():
    assert EngineArgs().to_engine_config() == EngineConfig()


def test_register_adds_serve_with_every_flag():
    app = typer.Typer()
    register(app)
    assert typer.main.get_command(app).name == "serve"
    result = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "300"})
    assert result.exit_code == 0
    for flag in ENGINE_FLAGS + SERVER_FLAGS:
        assert flag in result.output


def serve_exit(*flags: str):
    app = typer.Typer()
    register(app)
    return CliRunner().invoke(app, list(flags))


def test_auto_tool_choice_needs_a_parser_and_the_parser_a_known_name():
    without_parser = serve_exit("--enable-auto-tool-choice")
    assert without_parser.exit_code == 2 and "--tool-call-parser" in without_parser.output
    unknown = serve_exit("--tool-call-parser", "nope")
    assert unknown.exit_code == 2 and "hermes" in unknown.output


def test_the_parser_choices_are_the_registered_parsers():
    from paged_backend.server.cli import TOOL_CALL_PARSERS
    from paged_backend.server.tool_parsers import TOOL_PARSERS

    assert set(TOOL_CALL_PARSERS) == set(TOOL_PARSERS)


def test_chat_template_is_a_file_or_an_inline_template(tmp_path):
    from paged_backend.server.cli import server_chat_template

    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    assert server_chat_template(str(tmp_path / "t.jinja")) == template
    assert server_chat_template(template) == template and server_chat_template(None) is None
    missing = serve_exit("--chat-template", str(tmp_path / "missing.jinja"))
    assert missing.exit_code == 2 and "--chat-template: no such file" in missing.output


def test_cors_flags_take_vllms_json_lists_and_repeated_values():
    from paged_backend.server.cli import cors_settings

    assert cors_settings(['["https://a.example", "https://b.example"]'], None, ["x-a", "x-b"], True) == {
        "allow_credentials": True, "allowed_origins": ["https://a.example", "https://b.example"],
        "allowed_headers": ["x-a", "x-b"]}  # fmt: skip
    assert cors_settings(None, None, None, False) == {"allow_credentials": False}  # ServerSettings keeps "*"
