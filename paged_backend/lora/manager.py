"""`LoRAManager`: the engine's one contract with adapters.

- `resolve(lora_request)` loads (once) and checks an adapter when a request is added, outside the step loop.
- `admits(seq, active)` lets the scheduler keep at most `max_loras` distinct adapters among running requests.
- `activate(scheduled)` puts this step's adapters in device slots (LRU) and exposes each packed row's slot to
  the layers for the duration of one forward.
- `take_step()` (a parallel engine's driver) hands over the slot writes and row slots the other ranks replay.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from torch import nn

from paged_backend.errors import BadLoRAAdapter
from paged_backend.lora.adapter import LoRAAdapter, linear_shapes, load_adapter
from paged_backend.lora.layers import SlotLayers
from paged_backend.lora.request import LoRARequest


def served_adapters(engine) -> dict[str, LoRAAdapter]:
    """The adapters an engine serves by name (none when LoRA is disabled)."""
    return {} if engine.lora is None else engine.lora.adapters


class LoRAManager:
    """`layers` / `shapes`: the slots of this process's (possibly sharded) model and the whole model's linear
    shapes; both default to those of `model`."""

    def __init__(
        self,
        model: nn.Module,
        *,
        max_loras: int,
        max_lora_rank: int,
        layers: SlotLayers | None = None,
        shapes: dict[str, tuple[int, int]] | None = None,
    ) -> None:
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.adapters: dict[str, LoRAAdapter] = {}  # loaded, by name
        self.slots: OrderedDict[int, int] = OrderedDict()  # load_id -> device slot, least recently used first
        self.layers = layers or SlotLayers(model, max_loras, max_lora_rank)
        self.shapes = shapes or linear_shapes(model)
        weight = next(model.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        self._next_int_id = 1
        self.records_writes = False  # a parallel driver's: keep slot writes for the other ranks (`take_step`)
        self._writes: list[tuple[int, dict]] = []
        self._step_slots: list[int] = []  # the current step's slot per packed row, and its largest rank
        self._step_rank = 0

    @classmethod
    def for_engine(cls, config, model: nn.Module, parallel=None) -> LoRAManager:
        """The manager of one engine, with `config.lora_modules` loaded. A parallel engine's driver uses its rank's
        slots and the whole model's shapes, and records slot writes for the other ranks."""
        worker = None if parallel is None else parallel.worker
        manager = cls(
            model,
            max_loras=config.max_loras,
            max_lora_rank=config.max_lora_rank,
            layers=None if worker is None else worker.lora_layers,
            shapes=None if worker is None else worker.linear_shapes,
        )
        manager.records_writes = worker is not None
        for name, path in config.lora_modules.items():
            manager.add(name, path)
        return manager

    # ------------------------------------------------------------- registry
    def load(self, lora_request: LoRARequest) -> LoRAAdapter:
        """The adapter of that name, read and registered first if needed; raises `BadLoRAAdapter`."""
        adapter = self.adapters.get(lora_request.lora_name)
        return self.register(self.read(lora_request)) if adapter is None else adapter

    def read(self, lora_request: LoRARequest) -> LoRAAdapter:
        """Read and check an adapter without registering it (safe off the engine thread: reads files only)."""
        if not lora_request.lora_path:
            raise BadLoRAAdapter(
                f"LoRA adapter {lora_request.lora_name!r} is not loaded and the request gives no lora_path"
            )
        return load_adapter(
            lora_request.lora_name,
            lora_request.lora_int_id,
            lora_request.lora_path,
            self.shapes,
            max_rank=self.max_lora_rank,
            dtype=self.dtype,
            device=self.device,
        )

    def register(self, adapter: LoRAAdapter) -> LoRAAdapter:
        if adapter.name in self.adapters:
            raise BadLoRAAdapter(f"a LoRA adapter named {adapter.name!r} is already loaded; unload it or rename")
        self.adapters = {**self.adapters, adapter.name: adapter}  # replaced, not mutated: servers read it unlocked
        return adapter

    def request_for(self, name: str, path: str) -> LoRARequest:
        """A LoRARequest with a fresh integer id, for adapters named by flags or runtime loading."""
        used = {adapter.int_id for adapter in self.adapters.values()}
        while self._next_int_id in used:
            self._next_int_id += 1
        self._next_int_id += 1
        return LoRARequest(name, self._next_int_id - 1, path)

    def add(self, name: str, path: str) -> LoRAAdapter:
        """Load and register a named adapter from a directory."""
        return self.register(self.read(self.request_for(name, path)))

    def remove(self, name: str) -> None:
        """Forget an adapter. Requests already running with it finish with it; new ones cannot name it."""
        if name not in self.adapters:
            raise BadLoRAAdapter(f"no LoRA adapter named {name!r} is loaded; loaded: {sorted(self.adapters)}")
        self.adapters = {key: value for key, value in self.adapters.items() if key != name}

    @staticmethod
    def adapters_in(scheduler) -> dict[str, tuple[str, ...]]:
        """Names of the adapters running (or swapped out) and waiting, for vLLM's `lora_requests_info`."""

        def names(seqs) -> tuple[str, ...]:
            return tuple(sorted({s.request.lora_adapter.name for s in seqs if s.request.lora_adapter is not None}))

        return {
            "running_lora_adapters": names(scheduler.running + scheduler.swapped),
            "waiting_lora_adapters": names(scheduler.waiting),
        }

    # ------------------------------------------------------------ scheduling
    def admits(self, adapter: LoRAAdapter | None, active: Iterable[LoRAAdapter | None]) -> bool:
        """Whether a request with `adapter` may start next to requests using `active` adapters."""
        if adapter is None:
            return True
        ids = {a.load_id for a in active if a is not None}
        return adapter.load_id in ids or len(ids) < self.max_loras

    @contextmanager
    def activate(self, step_adapters: list[tuple[LoRAAdapter | None, int]]) -> Iterator[None]:
        """For one forward: `step_adapters` lists each packed sequence's adapter (or None) and its row count."""
        if all(adapter is None for adapter, _ in step_adapters):
            yield
            return
        in_step = {adapter.load_id: adapter for adapter, _ in step_adapters if adapter is not None}
        if len(in_step) > self.max_loras:
            raise RuntimeError(f"{len(in_step)} adapters in one step exceed max_loras={self.max_loras}")
        for adapter in in_step.values():
            self._slot(adapter, in_step)
        token_slots: list[int] = []
        for adapter, num_rows in step_adapters:
            token_slots += [-1 if adapter is None else self.slots[adapter.load_id]] * num_rows
        rank = max(adapter.rank for adapter in in_step.values())
        self._step_slots, self._step_rank = token_slots, rank
        try:
            with self.layers.step(token_slots, rank, self.device, self.dtype):
                yield
        finally:
            self._step_slots, self._step_rank = [], 0

    def take_step(self) -> tuple[list[tuple[int, dict]], list[int], int]:
        """The slot writes since the last call (CPU copies), this step's slot per packed row (empty: none) and the
        step's largest rank: what the other ranks of a parallel engine apply to their own slots."""
        writes, self._writes = self._writes, []
        return writes, list(self._step_slots), self._step_rank

    def _slot(self, adapter: LoRAAdapter, in_step: dict[int, LoRAAdapter]) -> int:
        if adapter.load_id in self.slots:
            self.slots.move_to_end(adapter.load_id)
            return self.slots[adapter.load_id]
        if len(self.slots) < self.max_loras:
            slot = len(self.slots)
        else:  # evict the least recently used adapter this step does not need
            victim = next(load_id for load_id in self.slots if load_id not in in_step)
            slot = self.slots.pop(victim)
        self.layers.write(slot, adapter.weights)
        if self.records_writes:
            self._writes.append((slot, {name: (a.cpu(), b.cpu(), s) for name, (a, b, s) in adapter.weights.items()}))
        self.slots[adapter.load_id] = slot
        return slot
