"""`AsyncLLMEngine`: the async front of the engine. Requests in, streams out, from any loop or thread.

Owns the public API: the cheap checks in the caller's thread (bad requests raise at once and leave nothing
behind), binding each stream to the caller's running loop (asyncio, uvloop or trio), and the engine's
lifetime. Text prompts are tokenized off the loop (`admission`); the core is reached only through an
`EngineCoreClient` (`core_client`): by default the in-process step thread (`inproc_client`), with
`core_process=True` a process of its own (`proc_client`). Never imports
torch, and never waits on the device or the tokenizer from a loop.
"""

from __future__ import annotations

import atexit
import functools
import gc
import os
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from asyncllm.async_engine.admission import Admission, max_token_chars_of
from asyncllm.async_engine.chat_session import ChatStream, open_chat
from asyncllm.async_engine.core_client import ClientFactory
from asyncllm.async_engine.health import EngineStalledError, check_step_age, step_age
from asyncllm.async_engine.ids import LiveRequests, check_request_id, new_request_id
from asyncllm.async_engine.inproc_client import Built, InProcClient
from asyncllm.async_engine.lifetime import build_core as _build
from asyncllm.async_engine.lifetime import drain as _drain
from asyncllm.async_engine.lifetime import draining_error as _draining
from asyncllm.async_engine.lifetime import shutdown as _shutdown
from asyncllm.async_engine.loop_fanout import LoopFanout
from asyncllm.async_engine.loops import current_loop_key, run_in_thread
from asyncllm.async_engine.lora_front import LoRAFront
from asyncllm.async_engine.mailbox import OutputSlot, new_slot
from asyncllm.async_engine.pooling_api import PoolingAPI
from asyncllm.async_engine.proc_client import ProcClient
from asyncllm.async_engine.router import OutputRouter
from asyncllm.async_engine.stream import RequestStream, collect
from asyncllm.chat import Message
from asyncllm.config import EngineConfig, SchedulerConfig
from asyncllm.config_device import DEFAULT_GRAMMAR_COMPILE_TIMEOUT, DeviceConfig, device_limits
from asyncllm.errors import EngineDeadError
from asyncllm.input_limits import PromptBounds, text_char_limit
from asyncllm.input_processor import InputProcessor
from asyncllm.outputs import RequestOutput
from asyncllm.sampling_params import SamplingParams

Prompt = str | list[int]
__all__ = ["AsyncLLMEngine", "EngineStalledError", "Prompt"]


class AsyncLLMEngine(PoolingAPI):
    """`AsyncLLMEngine(model, **engine_args)` loads the model in its step thread and serves requests.

    ```
    async with AsyncLLMEngine(path, num_kv_blocks=512) as engine:
        async for chunk in engine.stream("Hello", SamplingParams(max_tokens=16)):
            print(chunk.text, end="")
    ```

    Works from asyncio, uvloop and trio (anyio's backends); a stream belongs to the loop that made it.
    `add_request` returns at once and never runs the tokenizer on the loop: what it can check cheaply
    (types, params, empty or absurdly long prompts, token ids, invalid Unicode) raises there; what needs
    the tokenizer (a text prompt's length in tokens) or a compiler (an output constraint that does not
    compile) raises `InvalidRequestError` from the stream's first `__anext__` (or from `generate`).
    Requests reach the core in the order they were added (one with a constraint once it compiled).

    After loading, the objects alive are frozen out of the garbage collector (`gc.freeze()`): a full
    collection otherwise walks every object the model, tokenizer and libraries left, with the loop
    stalled, and they live as long as the process anyway.
    """

    config: EngineConfig | None

    def __init__(self, model: str, **engine_args: Any) -> None:
        config = EngineConfig.from_kwargs(model, **engine_args).resolved(streaming=True)  # bad ones raise here

        self.config = config
        sched, dev = config.scheduler_config, config.device_config
        build = functools.partial(_build, config)  # picklable: a core process builds it too
        client: ClientFactory = functools.partial(ProcClient if dev.core_process else InProcClient, build)
        self._start(client, time.monotonic, sched, dev)

    @classmethod
    def from_builder(
        cls,
        build: Callable[[], Built],
        *,
        clock: Callable[[], float] = time.monotonic,
        max_waiting_requests: int | None = None,
        max_step_seconds: float | None = None,
        grammar_compile_timeout: float = DEFAULT_GRAMMAR_COMPILE_TIMEOUT,
    ) -> AsyncLLMEngine:
        """An engine around a core made by `build()` (called in the step thread). `clock` must be the one
        the core was given: request arrival times come from it. `max_waiting_requests` and
        `grammar_compile_timeout` are the engine arguments of the same names, `max_step_seconds` (None:
        ASYNCLLM_MAX_STEP_SECONDS) the health bound (the front enforces them). For embedding and tests."""
        client = functools.partial(InProcClient, build)
        return cls.from_client(
            client,
            clock=clock,
            max_waiting_requests=max_waiting_requests,
            max_step_seconds=max_step_seconds,
            grammar_compile_timeout=grammar_compile_timeout,
        )

    @classmethod
    def from_client(
        cls,
        make_client: ClientFactory,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_waiting_requests: int | None = None,
        max_step_seconds: float | None = None,
        grammar_compile_timeout: float = DEFAULT_GRAMMAR_COMPILE_TIMEOUT,
    ) -> AsyncLLMEngine:
        """An engine around the core that `make_client(router)` reaches (see `EngineCoreClient`): for a core
        elsewhere (its own process, a Ray actor) and for tests. The rest as in `from_builder`."""
        # Checked as the engine arguments are (InvalidConfigError naming the argument).
        sched = SchedulerConfig(max_waiting_requests=max_waiting_requests)
        dev = device_limits(max_step_seconds, grammar_compile_timeout)
        engine = cls.__new__(cls)
        engine.config = None
        engine._start(make_client, clock, sched, dev)
        return engine

    def _start(
        self, make_client: ClientFactory, clock: Callable[[], float], sched: SchedulerConfig, dev: DeviceConfig
    ) -> None:
        self._clock = clock
        self._max_step_seconds = dev.max_step_seconds
        self._live: LiveRequests[OutputSlot] = LiveRequests(sched.max_waiting_requests)
        self._fanout = LoopFanout()
        client = self._client = make_client(OutputRouter(self._live, self._fanout))
        info = client.start()  # re-raises a load error here, in the constructor
        self._input_processor = InputProcessor(info.runtime, info.encode, info.encode_batch, info.check_constraint)
        self.tokenizer = info.tokenizer  # the Hugging Face tokenizer (chat templates), None if none
        self.runtime = info.runtime
        self._max_token_chars = max_token_chars_of(info.tokenizer)
        self._start_pooling(info.tokenizer)  # embed, score and rerank (pooling_api.py)
        self._admission = Admission(client, self._input_processor, clock, dev.grammar_compile_timeout)
        self._loras = LoRAFront(client, info.runtime.max_loras > 0, self._live.closed_error)
        # An engine dropped without shutdown still stops its threads and frees the device.
        self._finalizer = weakref.finalize(self, _shutdown, client, self._admission)
        gc.collect()  # garbage now would otherwise be frozen for good
        gc.freeze()
        # At exit the frozen objects must be collectable again, or extensions report them as leaked.
        atexit.unregister(gc.unfreeze)  # one registration however many engines were made
        atexit.register(gc.unfreeze)

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        lora: str | None = None,
        timeout: float | None = None,
    ) -> RequestStream:
        """Queue a request and return its stream at once; call it from the loop that will read the stream.

        `priority`: lower runs first (FIFO within a priority); a waiting request may preempt running ones
        of a lower priority when memory or seats run out. `lora`: the name of an adapter added with
        `add_lora`, whose weights the request runs through (None: the base model). `timeout`: seconds from
        now; a request not finished by then ends, waiting or running, its blocks freed within a step: its
        last chunk has finish_reason "timeout" once it has output, else the stream raises
        `RequestTimeoutError`.

        Raises at once: `InvalidRequestError` for a bad prompt (except its length in tokens, for text: see
        the class), bad params, priority or adapter name, or a duplicate live id; `EngineOverloadedError` when
        `max_waiting_requests` requests already wait to start; `EngineDrainingError` while draining;
        `EngineDeadError` when the engine has failed or was shut down. Never runs the tokenizer.
        """
        library, loop_key = current_loop_key()  # RuntimeError outside a running loop, saying so
        self._pooling.check_generates("add_request()")  # an embed or score engine generates nothing
        request_id = new_request_id() if request_id is None else check_request_id(request_id)
        dead = self._live.closed_error()
        if dead is not None:
            raise dead
        ip = self._input_processor
        priority = ip.check_priority(priority)
        lora = ip.check_lora(lora, self._loras.added)
        seconds = ip.check_timeout(timeout)
        arrival = self._clock()
        deadline = None if seconds is None else arrival + seconds
        text: tuple[str, SamplingParams] | None = None
        request = None
        if isinstance(prompt, str):
            text = (prompt, ip.check_params(params))
            ip.check_text(prompt, self._max_token_chars)
            n = text[1].n
        else:  # token ids: cheap, checked whole
            request = ip.make_request(
                request_id, prompt, params, arrival, priority=priority, lora=lora, deadline=deadline
            )
            n = request.params.n
        mailbox = self._fanout.attach(library, loop_key)
        slot = new_slot(request_id, mailbox, n)
        try:
            self._live.register(request_id, slot)
        except BaseException:
            self._fanout.detach(mailbox)
            raise
        if text is not None:
            self._admission.submit_text(slot, *text, arrival, priority, lora, deadline)
        else:
            assert request is not None
            self._admission.submit(slot, request)
        return RequestStream(slot, self._admission.abort)

    stream = add_request  # `async for chunk in engine.stream(prompt, params)`: the same call

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        lora: str | None = None,
        timeout: float | None = None,
    ) -> RequestOutput:
        """The whole result of one request. Cancelling the awaiting task aborts the request."""
        stream = self.add_request(prompt, params, request_id, priority=priority, lora=lora, timeout=timeout)
        return await collect(stream)

    async def abort(self, request_id: str) -> None:
        """End a live request; its stream then yields a final chunk with finish_reason "abort".
        An unknown or finished id is a no-op."""
        slot = self._live.get(check_request_id(request_id, optional=False))
        if slot is not None:
            self._admission.abort(slot)

    def chat(
        self,
        messages: Sequence[Message],
        params: SamplingParams | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] = "auto",
        parallel_tool_calls: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        request_id: str | None = None,
        priority: int = 0,
        lora: str | None = None,
        timeout: float | None = None,
    ) -> ChatStream:
        """`async for chunk in engine.chat(messages, params, tools=..., tool_choice=...)`: the reply as
        `ChatChunk`s (`text`, `reasoning_text`, `tool_calls` deltas, `finish_reason`; "tool_calls" when it
        called tools). `tools`: OpenAI function tools; `tool_choice`: "auto", "none" (the prompt lists the
        tools, the reply is text), "required" or `{"type": "function", "function": {"name": ...}}` (the last
        two force calls through a grammar); `parallel_tool_calls=False`: one call at most. `chat_template`
        replaces the model's template, `chat_template_kwargs` adds variables to it; `priority`, `lora` and
        `timeout` as in `add_request`. Bad messages, tools, params, priority, adapter or timeout raise
        `InvalidRequestError` here; what needs the template raises from the first chunk (see `ChatStream`).
        Leaving the stream early aborts it. `params.n` > 1: n replies as one request (the prompt prefilled
        once), their chunks labelled by `ChatChunk.index`, each reply parsed on its own and ended by its own
        finish reason."""
        self._pooling.check_generates("chat()")
        priority = self._input_processor.check_priority(priority)
        lora = self._input_processor.check_lora(lora, self._loras.added)
        self._input_processor.check_timeout(timeout)
        return open_chat(
            self.tokenizer,
            functools.partial(self.add_request, priority=priority, lora=lora, timeout=timeout),
            messages,
            params,
            tools=tools,
            tool_choice=tool_choice,
            parallel_tool_calls=parallel_tool_calls,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
            request_id=request_id,
            # The template's markers decide, not `runtime.architecture`: a Llama architecture (SmolLM2, say) does
            # not mean a template that shows the model its tools, nor Llama 3's call format.
            architecture=None,
            bounds=self.prompt_bounds,
        )

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """The conversation as prompt token ids, through the model's chat template (ids, not text: the
        template writes BOS and turn markers that encoding its text would add a second time)."""
        from asyncllm.chat import apply_chat_template

        return apply_chat_template(self.tokenizer, messages, add_generation_prompt=add_generation_prompt, tokenize=True)

    # ------------------------------------------------------------------ LoRA adapters
    async def add_lora(self, name: str, path: str | os.PathLike[str]) -> None:
        """Load the PEFT LoRA adapter in directory `path` and serve it as `name`: requests pick it with
        `lora=name`. Loaded on every rank between two steps: running streams lose nothing. Raises `LoRAError`,
        adding nothing, for an engine without `enable_lora`, a name taken, `max_cpu_loras` reached, or an
        adapter that cannot serve this model (docs/lora.md). Cancelling the wait does not undo the addition."""
        await self._loras.add(name, path)

    async def remove_lora(self, name: str) -> None:
        """Stop serving adapter `name`. Raises `LoRAError` for an unknown name, and while live requests use
        it (naming how many): abort them or let them finish first."""
        await self._loras.remove(name)

    def list_loras(self) -> list[str]:
        """The adapters added, in the order they were."""
        return self._loras.names()

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, float | int]:
        """num_running, num_waiting, num_free_blocks, num_total_blocks, prefix_cache_hit_rate, ...

        The core's part is a snapshot the step thread publishes after every step: never waits behind work
        in flight. The front adds `num_queued` (requests accepted and not started, exact now: what
        `max_waiting_requests` bounds) and `num_rejected` (requests refused with EngineOverloadedError).
        """
        live = self._live
        return {**self._client.stats(), "num_queued": live.num_waiting, "num_rejected": live.num_rejected}

    @property
    def prompt_bounds(self) -> PromptBounds:
        """How long a prompt may be, in tokens and in characters (a text prompt or a chat's messages longer
        than the longest sequence's tokens can spell is refused before tokenizing)."""
        return PromptBounds(self.runtime.max_seq_len, text_char_limit(self.runtime.max_seq_len, self._max_token_chars))

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
        return self._client.is_alive and self._live.admitting

    @property
    def is_draining(self) -> bool:
        """`drain()` began: live requests finish, new ones are refused."""
        return not self._live.closed and not self._live.admitting

    @property
    def step_thread_alive(self) -> bool:
        """The step thread has not exited yet (it may still be finishing a step after shutdown began)."""
        return self._client.is_alive

    @property
    def dead_error(self) -> EngineDeadError | None:
        """Why the engine no longer serves (failure or shutdown), or None while it does."""
        return self._live.closed_error()

    @property
    def step_seconds(self) -> float:
        """How long the step in flight has been running (0.0 between steps)."""
        return step_age(self._client.step_started)

    async def check_health(self, max_step_seconds: float | None = None) -> None:
        """Raise `EngineDeadError` (cause chained) unless the engine is serving: `EngineStalledError` while
        one step has run longer than `max_step_seconds` (None: the engine's, ASYNCLLM_MAX_STEP_SECONDS, 20 s
        by default), `EngineDrainingError` while draining (both are `EngineDeadError`s). Reads flags: never waits."""
        error = self._live.closed_error()
        if error is not None:
            raise error
        if not self._client.is_alive:
            raise EngineDeadError("engine step thread is not running")
        check_step_age(self.step_seconds, self._max_step_seconds if max_step_seconds is None else max_step_seconds)
        if self.is_draining:
            raise _draining()

    async def drain(self, timeout: float | None = 30.0) -> int:
        """Stop admitting, let live requests finish, then abort what is left; returns how many were aborted.

        At once, `add_request` raises `EngineDrainingError` (an `EngineDeadError`; the server answers 503)
        and so does `check_health`. Live streams run on for up to `timeout` seconds (None: until they end);
        those still running then end with finish_reason "abort", within a step. The engine stays up,
        refusing requests: close it next (`aclose`). Idempotent; safe to cancel (the refusal stays)."""
        return await _drain(self._live, self._admission.abort, timeout)

    # ------------------------------------------------------------------ lifetime
    def shutdown(self) -> None:
        """End pending streams with EngineDeadError("engine shut down"), stop and join the step thread,
        and release the device. Idempotent. Blocks until the step in flight ends: from a coroutine, use
        `await engine.aclose()`."""
        self._finalizer()

    async def aclose(self) -> None:
        # Streams fail and new requests are refused at once; the join (a step in flight) runs off the loop.
        self._client.request_stop()
        await run_in_thread(self._finalizer)

    async def __aenter__(self) -> AsyncLLMEngine:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
