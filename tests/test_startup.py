"""A command's start-up runs without the cyclic garbage collector and freezes its heap once the engine is built;
whatever happens, the caller's collector is left as it was (`paged_backend/startup.py`)."""

from __future__ import annotations

import gc
import weakref

import pytest
from typer.testing import CliRunner

from paged_backend.cli import app as cli_app
from paged_backend.startup import collector_paused, quiet_start, started, thaw
from paged_backend.worker.default_model import TINY_MODEL


class Node:
    itself: Node


@pytest.fixture(autouse=True)
def collector_as_found():
    assert gc.isenabled() and gc.get_freeze_count() == 0
    yield
    assert gc.isenabled() and gc.get_freeze_count() == 0, "the collector was not left as it was found"


def test_the_collector_is_off_until_started_then_on_with_the_heap_frozen():
    with quiet_start():
        assert not gc.isenabled()
        cycle = Node()
        cycle.itself = cycle  # garbage made during start-up: freed by started(), not frozen for good
        freed = weakref.ref(cycle)
        del cycle
        started()
        assert freed() is None
        assert gc.isenabled() and gc.get_freeze_count() > 0  # what is left is out of later collections' reach
        started()  # a second call changes nothing
        assert gc.isenabled()


def test_outside_a_command_started_changes_nothing_and_thaw_leaves_a_callers_freeze():
    started()  # a library caller's process: never frozen
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        thaw()  # sleep mode thaws only what a command froze
        assert gc.get_freeze_count() == frozen > 0
    finally:
        gc.unfreeze()


def test_thaw_gives_the_start_up_heap_back_to_the_collector():
    with quiet_start():
        started()
        assert gc.get_freeze_count() > 0
        thaw()
        assert gc.get_freeze_count() == 0 and gc.isenabled()


def test_a_collector_turned_off_by_the_caller_stays_off():
    gc.disable()
    try:
        with quiet_start():
            started()
            assert not gc.isenabled()
        assert not gc.isenabled() and gc.get_freeze_count() == 0
    finally:
        gc.enable()


@pytest.mark.parametrize("works", [True, False])
def test_run_in_process_leaves_the_callers_collector_as_it_was(works, tmp_path):
    model = TINY_MODEL if works else str(tmp_path / "absent.gguf")  # refused before any engine is built
    result = CliRunner().invoke(cli_app, ["run", "--model", model, "--device", "cpu", "--max-tokens", "2",
                                          "--no-progress"], input="Hello\n")  # fmt: skip
    assert result.exit_code == (0 if works else 2), result.output


def test_a_paused_collector_runs_again_after_the_block_even_when_it_raises():
    with pytest.raises(RuntimeError), collector_paused():
        assert not gc.isenabled()
        raise RuntimeError("a GGUF file transformers cannot read")
    assert gc.isenabled()
