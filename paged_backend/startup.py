"""A command's start-up without the cyclic garbage collector, and its start-up heap kept out of later collections.

Importing torch and transformers and building a model makes ~470,000 long-lived objects the collector tracks, and it
walks all of them again each time enough new ones pile up. A command that builds an engine runs inside
`quiet_start()`, which turns the collector off. Once the engine is built, `started()` collects once, freezes what is
left into the permanent generation and turns the collector back on: a long-running server's later collections skip
that heap, so a full collection, should one come, does not stall the engine loop for the ~0.5 s a pass over it takes
on a 2-core CPU (the engine itself makes few objects for the collector; the start-up is where it cost time).
vLLM freezes its heap after start-up for the same reason. Sleep mode `thaw()`s the heap before it collects the
weights it dropped. When the command returns, the heap is unfrozen and the collector left as it was: the
interpreter's last collection still frees everything (Triton's extension, which torch imports, warns of objects that
outlive the interpreter), and a command run in-process leaves its caller's collector as it found it. Library calls
never go through here.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

# Inside quiet_start(): "enabled", the collector's state before it; "quiet", until started(); "frozen", after it.
_state: dict[str, bool] = {}


@contextmanager
def quiet_start() -> Iterator[None]:
    """Run a command with the collector off until it calls `started()`; everything as it was afterwards."""
    enabled = gc.isenabled()
    with collector_paused():
        _state.update(enabled=enabled, quiet=True, frozen=False)
        try:
            yield
        finally:
            thaw()
            _state.clear()


@contextmanager
def collector_paused() -> Iterator[None]:
    """The collector off for a block that makes a great many objects that live through it (a GGUF file's parse:
    ~500,000 of them), as it was afterwards: each pass would walk all of them again."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def started() -> None:
    """The engine is built: free start-up's garbage once, freeze the rest, and collect as usual from here on."""
    if not _state.get("quiet"):
        return  # not a command's start (a library call), or started already
    gc.collect()
    gc.freeze()
    _state.update(quiet=False, frozen=True)
    if _state["enabled"]:
        gc.enable()


def thaw() -> None:
    """Unfreeze the heap `started()` froze (sleep mode, before it collects what it dropped); nobody else's."""
    if _state.get("frozen"):
        gc.unfreeze()
        _state["frozen"] = False
