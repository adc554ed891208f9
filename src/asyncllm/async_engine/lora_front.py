"""The async front's side of LoRA adapters: adding and removing them through the engine-core client (the core
runs the change between two steps; the caller awaits it off its loop), and the names added, so that a request
naming another is refused at once in the caller's thread (the core checks again: a removal racing a request
fails that request alone). Knows no event loop library beyond `run_in_thread`, and no torch.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future

from asyncllm.async_engine.core_client import EngineCoreClient
from asyncllm.async_engine.loops import run_in_thread
from asyncllm.errors import EngineDeadError, LoRAError


class LoRAFront:
    def __init__(
        self, client: EngineCoreClient, enabled: bool, closed_error: Callable[[], EngineDeadError | None]
    ) -> None:
        self._client = client
        self._enabled = enabled
        self._closed_error = closed_error
        self.added: dict[str, None] = {}  # adapter names, in the order they were added (an ordered set)

    def names(self) -> list[str]:
        return list(self.added)

    async def add(self, name: str, path: str | os.PathLike[str]) -> None:
        name = _check_name(name)
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise LoRAError(f"path={path!r} is invalid: give the adapter's directory")
        future = self._send(lambda: self._client.add_lora(name, os.fspath(path)))
        # Also when the awaiting task is cancelled: the core has the adapter all the same.
        future.add_done_callback(lambda f: _succeeded(f) and self.added.setdefault(name))
        await run_in_thread(future.result)
        self.added.setdefault(name)  # the callback may run after this task resumed: here too

    async def remove(self, name: str) -> None:
        name = _check_name(name)
        future = self._send(lambda: self._client.remove_lora(name))
        future.add_done_callback(lambda f: _succeeded(f) and self.added.pop(name, None))
        await run_in_thread(future.result)
        self.added.pop(name, None)

    def _send(self, send: Callable[[], Future[None]]) -> Future[None]:
        if not self._enabled:
            raise LoRAError("this engine was built without enable_lora=True: it serves no LoRA adapters")
        dead = self._closed_error()
        if dead is not None:
            raise dead
        return send()


def _succeeded(future: Future[None]) -> bool:
    return not future.cancelled() and future.exception() is None


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name.strip():
        raise LoRAError(f"name={name!r} is invalid: give the LoRA adapter a non-empty name")
    return name
