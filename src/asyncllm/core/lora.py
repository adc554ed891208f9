"""LoRA adapters as the engine core sees them: the adapters added (name -> a never-reused id), and the
scheduler's budget of distinct adapters among running requests (the device's `max_loras` slots).

An adapter is added and removed between steps; the executor loads it on every rank (and refuses one that
cannot serve the model) before it is registered here, so a request can only name a loaded adapter. Removing
one a live request uses is refused, naming how many do: the caller aborts them or lets them finish first (a
removal never pulls an adapter from under a stream, and a wait that might never end is the caller's to choose).
Plain Python; knows nothing of files or devices.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from asyncllm.errors import InvalidRequestError, LoRAError
from asyncllm.step import LoRAAdapter


@dataclass(frozen=True)
class LoRASettings:
    max_loras: int  # distinct adapters running at once (the device's slots); 0: LoRA disabled
    max_cpu_loras: int | None = None  # adapters added at once; None: no limit


class LoRARegistry:
    """The adapters added to one engine, by name."""

    def __init__(self, settings: LoRASettings) -> None:
        self.settings = settings
        self._by_name: dict[str, LoRAAdapter] = {}
        self._next_id = 1  # ids are never reused: 0 is the base model

    @property
    def enabled(self) -> bool:
        return self.settings.max_loras > 0

    def names(self) -> list[str]:
        return list(self._by_name)

    def add(self, name: str, path: str, load: Callable[[LoRAAdapter], None]) -> LoRAAdapter:
        """Register `name` once `load` (the executor's) accepted it; `LoRAError` and nothing changed else."""
        self._check_enabled()
        if name in self._by_name:
            raise LoRAError(f"a LoRA adapter named {name!r} is already added: remove it first, or pick another name")
        limit = self.settings.max_cpu_loras
        if limit is not None and len(self._by_name) >= limit:
            raise LoRAError(
                f"{len(self._by_name)} LoRA adapters are added, max_cpu_loras={limit}: remove one "
                f"({', '.join(self._by_name)}) or build the engine with a larger max_cpu_loras"
            )
        adapter = LoRAAdapter(self._next_id, name, path)
        try:
            load(adapter)
        except LoRAError as exc:
            raise LoRAError(f"cannot add LoRA adapter {name!r}: {exc}") from None
        self._next_id += 1
        self._by_name[name] = adapter
        return adapter

    def remove(self, name: str, users: Iterable[int], unload: Callable[[int], None]) -> None:
        """Unregister `name` unless a live request uses it (`users`: the adapter ids of live requests)."""
        adapter = self.get(name)
        in_use = sum(1 for lora_id in users if lora_id == adapter.lora_id)
        if in_use:
            raise LoRAError(
                f"LoRA adapter {name!r} is in use by {in_use} live request(s): abort them or let them finish, "
                "then remove it"
            )
        unload(adapter.lora_id)
        del self._by_name[name]

    def get(self, name: str) -> LoRAAdapter:
        self._check_enabled()
        adapter = self._by_name.get(name)
        if adapter is None:
            known = ", ".join(repr(n) for n in self._by_name) or "none"
            raise LoRAError(f"no LoRA adapter named {name!r} is added (added: {known}); add it with add_lora first")
        return adapter

    def resolve(self, name: str) -> int:
        """A request's adapter id; `InvalidRequestError` (the request fails alone) for an unknown name."""
        try:
            return self.get(name).lora_id
        except LoRAError as exc:
            raise InvalidRequestError(f"lora={name!r}: {exc}") from None

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise LoRAError("this engine was built without enable_lora=True: it serves no LoRA adapters")


class AdapterBudget:
    """Distinct adapters among running requests, at most `max_loras`: a request whose adapter is not running
    yet is admitted only while fewer are (the scheduler keeps its turn: it waits, in order, for one to end)."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._running: dict[int, int] = {}  # adapter id -> running requests using it

    def fits(self, lora_id: int) -> bool:
        return lora_id in self._running or len(self._running) < self.max_loras

    def acquire(self, lora_id: int) -> None:
        self._running[lora_id] = self._running.get(lora_id, 0) + 1

    def release(self, lora_id: int) -> None:
        left = self._running[lora_id] - 1
        if left:
            self._running[lora_id] = left
        else:
            del self._running[lora_id]
