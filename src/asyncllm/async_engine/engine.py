"""`AsyncLLMEngine`: the asyncio front of the engine. Requests in, streams out, from any loop or thread.

Owns the public API: validating requests in the caller's thread (bad ones raise at once and leave nothing
behind), binding each stream to the caller's running loop, and the engine's lifetime. The core lives in
the step thread (`step_loop`); this module never imports torch, and never waits on the device from a loop.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable
from typing import Any

from asyncllm.async_engine.ids import LiveRequests, check_request_id, new_request_id
from asyncllm.async_engine.loop_fanout import LoopFanout
from asyncllm.async_engine.mailbox import OutputSlot
from asyncllm.async_engine.step_loop import Built, StepLoop
from asyncllm.async_engine.stream import RequestStream
from asyncllm.config import EngineConfig
from asyncllm.errors import EngineDeadError
from asyncllm.outputs import RequestOutput
from asyncllm.sampling_params import SamplingParams

Prompt = str | list[int]

_SHUTDOWN_JOIN_S = 60.0  # longest a shutdown waits for a step in flight before giving up on the join


class AsyncLLMEngine:
    """`AsyncLLMEngine(model, **engine_args)` loads the model in its step thread and serves requests.

    ```
    async with AsyncLLMEngine(path, num_kv_blocks=512) as engine:
        async for chunk in engine.stream("Hello", SamplingParams(max_tokens=16)):
            print(chunk.text, end="")
    ```
    """

    config: EngineConfig | None

    def __init__(self, model: str, **engine_args: Any) -> None:
        config = EngineConfig.from_kwargs(model, **engine_args)  # bad arguments raise here, before any thread

        def build() -> Built:
            from asyncllm.build import build_engine  # torch loads only now, in the step thread

            return build_engine(config, time.monotonic)

        self.config = config
        self._start(build, time.monotonic)

    @classmethod
    def from_builder(cls, build: Callable[[], Built], *, clock: Callable[[], float] = time.monotonic) -> AsyncLLMEngine:
        """An engine around a core made by `build()` (called in the step thread). `clock` must be the one
        the core was given: request arrival times come from it. For embedding and tests."""
        engine = cls.__new__(cls)
        engine.config = None
        engine._start(build, clock)
        return engine

    def _start(self, build: Callable[[], Built], clock: Callable[[], float]) -> None:
        self._clock = clock
        self._live: LiveRequests[OutputSlot] = LiveRequests()
        self._fanout = LoopFanout()
        self._step_loop = StepLoop(build, self._live, self._fanout)
        built = self._step_loop.start()  # re-raises a load error here, in the constructor
        self._input_processor = built.input_processor
        self.tokenizer = built.tokenizer  # the Hugging Face tokenizer (chat templates), None if none
        self.runtime = built.runtime
        # An engine dropped without shutdown still stops its thread and frees the device.
        self._finalizer = weakref.finalize(self, self._step_loop.shutdown, _SHUTDOWN_JOIN_S)

    # ------------------------------------------------------------------ requests
    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> RequestStream:
        """Queue a request and return its stream at once; call it from the loop that will read the stream.

        Raises at once: `InvalidRequestError` for a bad prompt, bad params or a duplicate live id,
        `EngineDeadError` when the engine has failed or was shut down.
        """
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError(
                "add_request needs a running event loop: call it from a coroutine (the stream is bound to it)"
            ) from None
        request_id = new_request_id() if request_id is None else check_request_id(request_id)
        dead = self._live.closed_error()
        if dead is not None:
            raise dead
        request = self._input_processor.make_request(request_id, prompt, params, self._clock())
        mailbox = self._fanout.attach(loop)
        slot = OutputSlot(request_id, mailbox)
        try:
            self._live.register(request_id, slot)
        except BaseException:
            self._fanout.detach(mailbox)
            raise
        self._step_loop.submit_add(request, slot)
        return RequestStream(slot, request.prompt_token_ids, self._step_loop.submit_abort)

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> RequestStream:
        """`async for chunk in engine.stream(prompt, params)`: the same as `add_request`."""
        return self.add_request(prompt, params, request_id)

    async def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> RequestOutput:
        """The whole result of one request. Cancelling the awaiting task aborts the request."""
        stream = self.add_request(prompt, params, request_id)
        texts: list[str] = []
        token_ids: list[int] = []
        logprobs: list[dict[int, float]] | None = None
        last = None
        try:
            async for chunk in stream:
                texts.append(chunk.text)
                token_ids.extend(chunk.token_ids)
                if chunk.logprobs is not None:
                    logprobs = logprobs or []
                    logprobs.extend(chunk.logprobs)
                last = chunk
        finally:
            stream.close()  # a no-op once finished; otherwise (an error) the request must not run on
        assert last is not None and last.finish_reason is not None, "a stream ends with a final chunk"
        return RequestOutput(
            request_id=stream.request_id,
            prompt_token_ids=list(stream.prompt_token_ids),
            text="".join(texts),
            token_ids=token_ids,
            finish_reason=last.finish_reason,
            metrics=last.metrics,
            logprobs=logprobs,
        )

    async def abort(self, request_id: str) -> None:
        """End a live request; its stream then yields a final chunk with finish_reason "abort".
        An unknown or finished id is a no-op."""
        slot = self._live.get(request_id)
        if slot is not None:
            self._step_loop.submit_abort(slot)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """The conversation as prompt token ids, through the model's chat template (ids, not text: the
        template writes BOS and turn markers that encoding its text would add a second time)."""
        from asyncllm.chat import apply_chat_template

        return apply_chat_template(self.tokenizer, messages, add_generation_prompt=add_generation_prompt, tokenize=True)

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, float | int]:
        """num_running, num_waiting, num_free_blocks, num_total_blocks, prefix_cache_hit_rate, ...

        A snapshot the step thread publishes after every step: never waits behind work in flight.
        """
        return dict(self._step_loop.stats)

    @property
    def num_live_requests(self) -> int:
        """Requests admitted whose final output has not yet been routed to their stream."""
        return len(self._live)

    @property
    def num_event_loops(self) -> int:
        """Event loops with live requests (a loop's mailbox goes with its last request)."""
        return self._fanout.num_loops

    @property
    def is_running(self) -> bool:
        """The step thread is alive and new requests are accepted."""
        return self._step_loop.is_alive and not self._live.closed

    @property
    def step_thread_alive(self) -> bool:
        """The step thread has not exited yet (it may still be finishing a step after shutdown began)."""
        return self._step_loop.is_alive

    @property
    def dead_error(self) -> EngineDeadError | None:
        """Why the engine no longer serves (failure or shutdown), or None while it does."""
        return self._live.closed_error()

    async def check_health(self) -> None:
        """Raise `EngineDeadError` (cause chained) unless the engine is serving. Reads a flag: never waits."""
        error = self._live.closed_error()
        if error is not None:
            raise error
        if not self._step_loop.is_alive:
            raise EngineDeadError("engine step thread is not running")

    # ------------------------------------------------------------------ lifetime
    def shutdown(self) -> None:
        """End pending streams with EngineDeadError("engine shut down"), stop and join the step thread,
        and release the device. Idempotent. Blocks until the step in flight ends: from a coroutine, use
        `await engine.aclose()`."""
        self._finalizer()

    async def aclose(self) -> None:
        # Streams fail and new requests are refused at once; the join (a step in flight) runs off the loop.
        self._step_loop.request_stop()
        await asyncio.to_thread(self._finalizer)

    async def __aenter__(self) -> AsyncLLMEngine:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
