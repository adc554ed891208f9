"""The engine core as the async front sees it: `EngineCoreClient`, one protocol wherever the core runs.

`AsyncLLMEngine` reaches its core only through this protocol: requests in with the output slot each feeds,
aborts, outputs routed back to the callers' event loops, stats, health and shutdown. The in-process step
thread (`inproc_client.py`) is the first implementation; a core in its own process or behind a Ray actor is
one more file implementing it, reusing `inbox.Inbox` (requests in, in order, from any thread) and
`router.OutputRouter` (outputs to their streams). Knows no event loop, no torch, nor how a core is built.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from asyncllm.async_engine.mailbox import OutputSlot
    from asyncllm.async_engine.router import OutputRouter
    from asyncllm.chat import ChatTokenizer
    from asyncllm.core.output_processor import RequestDelta
    from asyncllm.core.request import Request
    from asyncllm.input_processor import CheckConstraint, Encode, EncodeBatch
    from asyncllm.step import RuntimeInfo


class CoreInfo(Protocol):
    """What a started core tells its front: enough to check and tokenize requests on the front side."""

    @property
    def runtime(self) -> RuntimeInfo: ...  # what was learned at load: vocabulary, KV capacity, EOS ids, device
    @property
    def tokenizer(self) -> ChatTokenizer | None: ...  # the Hugging Face tokenizer (chat templates), None if none
    @property
    def encode(self) -> Encode | None: ...  # text to prompt ids; None without a tokenizer
    @property
    def encode_batch(self) -> EncodeBatch | None: ...  # `encode` of many texts in one call; None: one by one
    @property
    def check_constraint(self) -> CheckConstraint | None: ...  # compiles an output constraint; None: unavailable


class EngineCoreClient(Protocol):
    """The front's handle on one engine core, in this process or elsewhere.

    A client is made around the engine's `OutputRouter` (see `ClientFactory`) and started once. From then
    on every output of the core reaches its stream through that router (`route`, once per step; before it,
    `started` with the ids of the requests whose first step was planned, which keeps the front's count of
    waiting requests, `max_waiting_requests`, exact), and the
    core's death, whatever its cause (a failed step, a worker or process lost while idle, a failed load),
    closes the router: every live stream and every later request gets `EngineDeadError`, cause chained.

    Requests: `add_request`, `abort_request` and `end_request` may be called from any thread (callers'
    loops, the tokenizer thread, a garbage collection), return without waiting on the core, and take effect
    in the order they were called. Before it handles a request's message the client checks that the slot is
    still live (`OutputRouter.is_live`); so an abort of a finished or unknown request is a no-op, and a stale
    one never hits a later request that reuses the id. Aborts reach the core within a step: a request aborted
    while a step runs gets no token from that step, and its final output ("abort") is routed like any other.
    """

    @property
    def lock(self) -> threading.RLock:
        """Admission holds it around its own queue and its calls to `add_request`, `abort_request` and
        `end_request`, so no request overtakes one queued before it, and a stream dropped inside the
        client's locked region can abort without deadlock (hence reentrant). The client holds it only to
        enqueue or to sleep until woken, never while the core computes."""
        ...

    def start(self) -> CoreInfo:
        """Bring the core up and wait until it is ready; re-raise its load error here, in the caller."""
        ...

    def add_request(self, request: Request, slot: OutputSlot) -> None:
        """Queue a checked request whose outputs feed `slot` (registered live by the caller)."""
        ...

    def abort_request(self, slot: OutputSlot) -> None:
        """Abort `slot`'s request: synchronous into the queue, idempotent, a no-op once stopping."""
        ...

    def end_request(self, slot: OutputSlot, delta: RequestDelta) -> None:
        """Route `delta`, the last output of a request that never reached the core (aborted or refused in
        admission), in order with the messages before it; a no-op once stopping."""
        ...

    def stats(self) -> dict[str, float | int]:
        """The latest snapshot the core published (num_running, num_free_blocks, ...); never waits on work."""
        ...

    def add_lora(self, name: str, path: str) -> Future[None]:
        """Have the core add the LoRA adapter at `path` as `name` between steps (`EngineCore.add_lora`); the
        future resolves once every rank loaded it, or with its `LoRAError` (`EngineDeadError` if the core
        stops first). Any thread; returns at once."""
        ...

    def remove_lora(self, name: str) -> Future[None]:
        """`add_lora`'s twin for `EngineCore.remove_lora` (`LoRAError` while a live request uses it)."""
        ...

    @property
    def step_started(self) -> float | None:
        """`time.monotonic()` when the step in flight began, None between steps (health reads its age)."""
        ...

    @property
    def is_alive(self) -> bool:
        """The client still drives its core (it may be finishing a step after a stop was asked)."""
        ...

    @property
    def failure(self) -> BaseException | None:
        """What killed the core after it started; None while it serves, and after a clean shutdown."""
        ...

    def request_stop(self) -> None:
        """End every live stream with `EngineDeadError("engine shut down")` and refuse new requests at once;
        the core stops after the step in flight and releases the device. Never blocks; idempotent."""
        ...

    def shutdown(self, timeout: float | None) -> None:
        """`request_stop`, then wait up to `timeout` for the core to be released. Idempotent; safe from the
        client's own threads."""
        ...


ClientFactory = Callable[["OutputRouter"], EngineCoreClient]  # the client around the engine's router
