"""One replica: the body of a Ray actor holding an engine core, fed by the front and streaming back its steps.

`start` builds the core in the step thread of the same `InProcClient` a single engine uses (one GPU, or
a TP group whose workers the engine starts itself: the shared-memory ring and NCCL stay the data path
inside the replica); `submit` applies the front's numbered message batches in order (Ray does not promise
an async actor's calls run in the order sent); `outputs` is the Ray streaming generator that carries every
step's outputs back. The pool makes the class remote (`ray.remote(ReplicaActor)`); it imports no Ray at
module level and knows nothing of routing or of other replicas.
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from asyncllm.async_engine.inproc_client import Built, InProcClient
from asyncllm.errors import InvalidRequestError
from asyncllm.ray.outbox import ReplicaOutbox, Ticket
from asyncllm.ray.wire import AddRequest, Batch, Message, ReplicaInfo, portable

if TYPE_CHECKING:
    from asyncllm.config import EngineConfig
    from asyncllm.structured import StructuredOutput


def build_from_config(config: EngineConfig) -> Built:
    """The replica's engine core for `config` (torch loads here, in the replica's step thread)."""
    from asyncllm.build import build_engine

    return build_engine(config, time.monotonic)


class ReplicaActor:
    """Made cheap (`__init__` builds nothing) so a failed load comes back from `start` as a value."""

    def __init__(self) -> None:
        self._client: InProcClient[Ticket] | None = None
        self._outbox: ReplicaOutbox | None = None
        self._due: asyncio.Event | None = None
        self._built: Built | None = None
        self._next_seq = 0
        self._held: dict[int, list[Message]] = {}  # batches that arrived ahead of an earlier one

    async def start(self, build: Callable[[], Built]) -> ReplicaInfo | BaseException:
        """Build the core (in its step thread); the front's copy of what it needs, or the load error."""
        import ray

        loop = asyncio.get_running_loop()
        due = self._due = asyncio.Event()

        def wake() -> None:  # from the step thread
            loop.call_soon_threadsafe(due.set)

        self._outbox = outbox = ReplicaOutbox(wake)
        client: InProcClient[Ticket] = InProcClient(build, outbox)
        try:
            built = await asyncio.to_thread(client.start)
        except BaseException as exc:  # every load failure goes back to the front, whatever it is
            return portable(exc) or exc
        self._client, self._built = client, built
        outbox.stats = client.stats
        gc.collect()  # as AsyncLLMEngine does: the model's objects live as long as the process
        gc.freeze()
        node = ray.get_runtime_context().get_node_id()
        checks = built.check_constraint is not None
        return ReplicaInfo(
            built.runtime, built.tokenizer, built.encode, built.encode_batch, checks, os.getpid(), node, client.stats()
        )

    async def submit(self, seq: int, messages: list[Message]) -> None:
        """The front's batch number `seq` (from 0), applied once every earlier one is."""
        client, outbox = self._client, self._outbox
        assert client is not None and outbox is not None, "submit before start"
        self._held[seq] = messages
        now = time.monotonic()
        while self._next_seq in self._held:
            for message in self._held.pop(self._next_seq):
                if isinstance(message, AddRequest):
                    request = message.request
                    request.arrival_time = now - message.waited  # the front's clock may not be ours
                    client.add_request(request, outbox.admit(request.request_id))
                else:
                    ticket = outbox.ticket(message.request_id)
                    if ticket is not None:  # else finished already: a no-op, as in one engine
                        client.abort_request(ticket)
            self._next_seq += 1

    async def outputs(self) -> AsyncIterator[Batch]:
        """Every step's outputs, batched while the front reads the previous one; ends after the engine's
        death or shutdown, with that batch."""
        due, outbox = self._due, self._outbox
        assert due is not None and outbox is not None, "outputs before start"
        while True:
            await due.wait()
            due.clear()
            batch = outbox.take()
            if batch is None:
                continue
            yield batch
            if batch.dead is not None:
                return

    async def check_constraint(self, structured: StructuredOutput) -> str | None:
        """Compile an output constraint (cached here); the error naming what is wrong, or None."""
        check = self._built.check_constraint if self._built is not None else None
        if check is None:
            return "this replica cannot compile output constraints"
        try:
            await asyncio.to_thread(check, structured)
        except InvalidRequestError as exc:
            return str(exc)
        return None

    async def stop(self, timeout: float) -> None:
        """End the replica's requests ("engine shut down") and release the device."""
        if self._client is not None:
            await asyncio.to_thread(self._client.shutdown, timeout)
