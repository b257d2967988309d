"""Sleep mode (vLLM's `/sleep` and `/wake_up`): an idle engine gives its memory back, and takes it again on waking.

Level 1 releases the KV pool: its tensors (the CPU swap space and a draft model's pool too) are dropped, so their
memory goes back to the allocator, and on Linux the freed heap goes back to the OS (`malloc_trim`), so the RSS
drops. Level 2 also drops the weights: the model moves to the meta device (its config stays readable) and the
runner goes with its packed copies; waking loads the model again from the engine config's source, as the engine
first did (`worker.models.load_configured`: a directory, hub id, GGUF file or the seeded tiny model), and builds
a new runner over the same pool (a draft model keeps its weights). Either way the pool comes back zeroed, with
every cached prefix forgotten (their KV is gone), so every block is free again.

Sleep is for an idle engine: with requests unfinished, `sleep` raises `EngineBusy` naming them and frees nothing
(a caller waits for them or aborts them first, then sleeps). All of it runs on the engine thread
(`AsyncEngine.sleep` / `wake_up`), between two steps.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import sys
import time
from typing import TYPE_CHECKING

import torch

from paged_backend import startup
from paged_backend.engine.assembly import attach_decode_graphs
from paged_backend.errors import InvalidRequest, PagedBackendError
from paged_backend.worker.model_worker import model_runner
from paged_backend.worker.models import load_configured

if TYPE_CHECKING:
    from paged_backend.engine.engine import Engine

logger = logging.getLogger(__name__)

LEVELS = (1, 2)
TAGS = ("weights", "kv_cache")  # vLLM's wake_up tags: what to bring back (RLHF wakes the weights, syncs, then the KV)
MAX_NAMED = 10  # request ids an EngineBusy message names


class EngineBusy(PagedBackendError):
    """Sleep was asked for while requests are unfinished; `request_ids` are theirs."""

    def __init__(self, request_ids: list[str]) -> None:
        self.request_ids = request_ids
        named = ", ".join(repr(request_id) for request_id in request_ids[:MAX_NAMED])
        more = f" and {len(request_ids) - MAX_NAMED} more" if len(request_ids) > MAX_NAMED else ""
        super().__init__(
            f"{len(request_ids)} request(s) are still running ({named}{more}); sleep is for an idle engine: "
            f"let them finish (or cancel them), then ask again"
        )


class EngineSleep:
    """One engine's sleep state: `level` 0 (awake), 1 (KV pool released) or 2 (the weights dropped too)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.asleep: set[str] = set()  # the TAGS now released

    @property
    def level(self) -> int:
        return 2 if "weights" in self.asleep else 1 if self.asleep else 0

    def refusal(self, level: int) -> str | None:
        """Why this engine cannot sleep at `level`, or None."""
        engine = self.engine
        if level not in LEVELS:
            return f"sleep level {level} does not exist; use level=1 (free the KV cache) or level=2 (and the weights)"
        if engine.parallel is not None:
            return "sleep mode runs on one-process engines; this one spans tensor/pipeline-parallel ranks"
        if level == 2 and not engine.runner.owns_model:
            return ("level 2 reloads the weights from --model, but this engine runs a model object it was handed; "
                    "use level=1")  # fmt: skip
        if level == 2 and engine.lora is not None:
            return "level 2 would drop the weights LoRA adapters are attached to; use level=1 with --enable-lora"
        return None

    def sleep(self, level: int) -> None:
        """Sleep at `level` (deepening a lighter sleep; a deeper one stays as it is). Raises InvalidRequest for a
        level this engine cannot take, EngineBusy while requests run."""
        if level <= self.level:
            return
        reason = self.refusal(level)
        if reason is not None:
            raise InvalidRequest(reason)
        if self.engine.has_unfinished_requests():
            raise EngineBusy(sorted(self.engine.requests))
        started = time.perf_counter()
        if "kv_cache" not in self.asleep:
            self._release_pools()
            self.asleep.add("kv_cache")
        if level == 2:
            self._drop_weights()
            self.asleep.add("weights")
        _give_memory_back(self.engine.kv_cache.device)
        logger.info("engine asleep at level %d (%.2f s)", level, time.perf_counter() - started)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what the sleep dropped, or only the `tags` named (a no-op for what is awake). The engine
        serves once nothing is left asleep. A failed reload leaves the engine asleep."""
        unknown = sorted(set(tags or ()) - set(TAGS))
        if unknown:
            raise InvalidRequest(f"wake_up tags {', '.join(map(repr, unknown))} do not exist; use {' or '.join(TAGS)}")
        waking = self.asleep & set(tags or TAGS)
        if not waking:
            return
        started = time.perf_counter()
        if "weights" in waking:
            self._load_weights()
            _give_memory_back(self.engine.kv_cache.device)  # loading's transient copies (a GGUF's dequantization)
            self.asleep.discard("weights")
        if "kv_cache" in waking:
            for pool in self._pools():
                pool.allocate()
            self.asleep.discard("kv_cache")
        graphs = None if self.engine.runner is None else self.engine.runner.decode_graphs
        if not self.asleep and graphs is not None:  # over the new pool's addresses, before any step needs one
            graphs.capture_all()
        logger.info("woke %s (%.2f s)%s", " and ".join(sorted(waking)), time.perf_counter() - started,
                    "" if self.asleep else "; engine awake")  # fmt: skip

    def _pools(self) -> list:
        """The engine's KV pool, and the draft model's when one speculates."""
        draft = getattr(self.engine.speculator, "draft", None)
        return [self.engine.kv_cache] + ([draft.kv_cache] if draft is not None else [])

    def _release_pools(self) -> None:
        # Cached prefixes would point at KV that is gone: forgotten now, so waking starts with every block free.
        self.engine.block_manager.reset_prefix_cache()
        if self.engine.runner.decode_graphs is not None:  # their memory too; they hold the pool's addresses anyway
            self.engine.runner.decode_graphs.drop()
        for pool in self._pools():
            pool.release()

    def _drop_weights(self) -> None:
        engine = self.engine
        engine.runner = None  # its packed weight copies and fused-forward handles go with it
        engine.model.to("meta")  # storage dropped; the config and generation config stay readable

    def _load_weights(self) -> None:
        engine = self.engine
        config = engine.config
        model, _ = load_configured(config)  # the engine keeps its tokenizer: the same source gives the same one
        backend = None if config.attention_backend == "auto" else config.attention_backend
        engine.runner = model_runner(model, engine.kv_cache, backend, pack=config.prepack_weights, release=True,
                                     batch_invariant=config.batch_invariant)  # fmt: skip
        attach_decode_graphs(config, engine.runner, engine.kv_cache, engine.max_model_len)
        engine.model = model


def _give_memory_back(device: torch.device) -> None:
    """Return freed memory to the system: CUDA's cached blocks, and on Linux the heap glibc keeps after a free."""
    startup.thaw()  # a command's frozen start-up heap holds what was just dropped
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc (musl): its allocator returns memory its own way
            pass
