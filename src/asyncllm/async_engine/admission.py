"""Admission: requests reach the core in the order they were added, text prompts tokenized off the loop,
output constraints compiled beside them.

A request whose prompt is token ids is built at once in the caller's thread (its checks are cheap); a text
prompt is tokenized by one worker thread, so no event loop ever runs the tokenizer. Requests pass to the
engine-core client in arrival order: a request added behind one still being tokenized waits for it. A
request with an output constraint leaves that order once built: its constraint compiles in a thread of its
own (`compiles`, at most `grammar_compile_timeout` seconds), and it goes on when compiled, so a slow compile
holds up no request but its own. A request aborted or refused before it reached the core ends here. Knows
nothing of event loops.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from asyncllm.async_engine.compiles import Compiles
from asyncllm.async_engine.mailbox import OutputSlot
from asyncllm.config_device import DEFAULT_GRAMMAR_COMPILE_TIMEOUT
from asyncllm.core.output_processor import RequestDelta
from asyncllm.errors import AsyncLLMError, GrammarCompileTimeoutError, InvalidRequestError, RequestTimeoutError
from asyncllm.outputs import RequestMetrics
from asyncllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from asyncllm.async_engine.core_client import EngineCoreClient
    from asyncllm.core.request import Request
    from asyncllm.input_processor import InputProcessor

logger = logging.getLogger(__name__)

_MAX_BATCH = 64  # texts tokenized per call: large enough to amortise, small enough to keep arrival latency


class _Job:
    __slots__ = (
        "arrival_time",
        "cancelled",
        "deadline",
        "lora",
        "params",
        "priority",
        "prompt",
        "ready",
        "request",
        "slot",
    )

    def __init__(
        self,
        slot: OutputSlot,
        request: Request | None,
        prompt: str,
        params: SamplingParams,
        t: float,
        priority: int,
        lora: str | None = None,
        deadline: float | None = None,
    ) -> None:
        self.slot = slot
        self.lora = lora
        self.deadline = request.deadline if request is not None else deadline
        self.request = request  # None until the worker has tokenized `prompt`
        self.prompt = prompt
        self.params = params
        self.arrival_time = t
        self.priority = priority
        self.cancelled = False  # ended here (aborted): the worker drops it
        # Nothing left for the worker: a built request (one with a constraint compiles elsewhere).
        self.ready = request is not None


class Admission:
    """`submit` and `abort` from any thread; `stop` ends the worker. Requests go on to `client`.

    Its lock is the client's own (reentrant) one: this class calls into the client while holding it, and a
    stream garbage-collected inside the client's locked region calls `abort`, so two locks could each be
    held waiting for the other.
    """

    def __init__(
        self,
        client: EngineCoreClient,
        input_processor: InputProcessor,
        clock: Callable[[], float],
        compile_timeout: float = DEFAULT_GRAMMAR_COMPILE_TIMEOUT,
    ) -> None:
        self._input_processor = input_processor
        self._client = client
        self._clock = clock
        self._compile_timeout = compile_timeout
        self._compiles: Compiles[_Job, str | AsyncLLMError | None] = Compiles(
            self._compile, self._compiled, self._compile_timed_out, compile_timeout
        )
        self._cond = threading.Condition(client.lock)
        self._queue: deque[_Job] = deque()  # in arrival order; the head may be tokenizing
        self._queued: dict[OutputSlot, _Job] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None  # started with the first job it has work for

    def submit(self, slot: OutputSlot, request: Request) -> None:
        """A request built in the caller's thread: to the core now, unless a request ahead is still being
        tokenized, or its own output constraint must compile first."""
        slot.prompt_token_ids = tuple(request.prompt_token_ids)
        with self._cond:
            if request.params.structured is not None:
                job = _Job(slot, request, "", request.params, request.arrival_time, request.priority)
                self._queued[slot] = job
                self._compiles.submit(job)
            elif not self._queue:
                self._client.add_request(request, slot)  # under the lock: the worker cannot pass it
            else:
                self._enqueue(_Job(slot, request, "", request.params, request.arrival_time, request.priority))

    def submit_text(
        self,
        slot: OutputSlot,
        prompt: str,
        params: SamplingParams,
        arrival_time: float,
        priority: int,
        lora: str | None = None,
        deadline: float | None = None,
    ) -> None:
        """A text prompt that passed the cheap checks: tokenized and checked on the worker thread."""
        with self._cond:
            self._enqueue(_Job(slot, None, prompt, params, arrival_time, priority, lora, deadline))

    def abort(self, slot: OutputSlot) -> None:
        """Any thread, idempotent. A request still here ends at once with "abort" and never reaches the core."""
        with self._cond:
            job = self._queued.pop(slot, None)
            if job is None:
                self._client.abort_request(slot)  # in the core (or finished): the client decides
                return
            job.cancelled = True
            for delta in self._finals(job, None):
                self._client.end_request(slot, delta)

    def stop(self, timeout: float | None = None) -> None:
        self._compiles.stop()
        with self._cond:
            self._stopping = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    @property
    def num_queued(self) -> int:
        return len(self._queued)

    def _enqueue(self, job: _Job) -> None:
        if self._thread is None and not job.ready:
            self._thread = threading.Thread(target=self._run, name="asyncllm-tokenize", daemon=True)
            self._thread.start()
        self._queue.append(job)
        self._queued[job.slot] = job
        self._cond.notify()

    def _finals(self, job: _Job, error: str | AsyncLLMError | None) -> list[RequestDelta]:
        """The last outputs of a request that never reached the core: "abort" for each sample, or one
        delta with `error` when refused (which ends every sample)."""
        n = len(job.slot.prompt_token_ids or ())
        now = self._clock()
        metrics = RequestMetrics(None, now - job.arrival_time, n, 0, 0)
        rid = job.slot.request_id
        if error is not None:
            return [RequestDelta(rid, [], "", "abort", metrics, error=error)]
        num = job.slot.num_samples
        return [RequestDelta(rid, [], "", "abort", metrics, index=i, open_samples=num - 1 - i) for i in range(num)]

    # ------------------------------------------------------------------ the worker thread
    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stopping)
                if self._stopping:
                    return
                # The jobs to prepare at the head (they stay queued, so later requests keep their place behind).
                batch: list[_Job] = []
                for job in self._queue:
                    if job.ready or len(batch) == _MAX_BATCH:
                        break
                    batch.append(job)
            results = self._prepare(batch)
            with self._cond:
                for job, (request, error) in zip(batch, results):
                    self._queue.popleft()
                    self._pass_on(job, request, error)
                while self._queue and self._queue[0].ready:  # built requests queued behind
                    job = self._queue.popleft()
                    self._pass_on(job, job.request, None)

    def _prepare(self, batch: list[_Job]) -> list[tuple[Request | None, str | None]]:
        wanted = [job for job in batch if not (job.cancelled or job.slot.finished)]  # else aborted, or dead
        texts = [job for job in wanted if job.request is None]
        encoded: dict[_Job, list[int]] = {}
        if texts:
            try:
                encoded = dict(zip(texts, self._input_processor.encode_texts([job.prompt for job in texts])))
            except Exception:  # one text the tokenizer refuses: encode them one by one, to fail that one alone
                encoded = {}
        return [self._make(job, encoded.get(job)) if job in wanted else (None, None) for job in batch]

    def _make(self, job: _Job, encoded: list[int] | None) -> tuple[Request | None, str | None]:
        """The job's request, tokenized if its prompt is text; or the error."""
        rid = job.slot.request_id
        try:
            request = job.request or self._input_processor.make_request(
                rid,
                job.prompt,
                job.params,
                job.arrival_time,
                encoded,
                priority=job.priority,
                lora=job.lora,
                deadline=job.deadline,
            )
            return request, None
        except InvalidRequestError as exc:
            return None, str(exc)
        except Exception as exc:  # the tokenizer's own failure: it fails this request alone
            logger.warning("asyncllm: tokenizing request %r failed", rid, exc_info=exc)
            return None, f"the tokenizer failed on this prompt: {exc!r}"

    # ------------------------------------------------------------------ compiles (`Compiles`' threads)
    def _compile(self, job: _Job) -> str | AsyncLLMError | None:
        """Compile the job's output constraint: None, or why it failed (the error its request ends with)."""
        if job.cancelled or job.slot.finished:
            return None  # aborted, or the engine failed: nothing to compile for
        try:
            self._input_processor.check_constraint(job.params)
            return None
        except InvalidRequestError as exc:
            return str(exc)
        except Exception as exc:  # the compiler's own failure: it fails this request alone
            rid = job.slot.request_id
            logger.warning("asyncllm: compiling the output constraint of request %r failed", rid, exc_info=exc)
            return f"compiling this request's output constraint failed: {exc!r}"

    def _compile_timed_out(self, job: _Job) -> AsyncLLMError:
        field = job.params.structured.field if job.params.structured is not None else "grammar"
        return GrammarCompileTimeoutError(
            f"SamplingParams.{field} did not compile within grammar_compile_timeout ({self._compile_timeout:g} s): "
            "a simpler constraint compiles faster; the request ended and its compile was dropped"
        )

    def _compiled(self, job: _Job, error: str | AsyncLLMError | None) -> None:
        with self._cond:  # no request when the engine failed meanwhile: its slot holds that error already
            self._pass_on(job, job.request if error is None and not job.slot.finished else None, error)

    def _pass_on(self, job: _Job, request: Request | None, error: str | AsyncLLMError | None) -> None:
        """Under the lock: to the core (or, with a constraint not compiled yet, to the compiles), or ended here."""
        if job.cancelled:
            return  # `abort` already ended it
        if request is not None and error is None and request.params.structured is not None and job.request is None:
            job.request = request  # a text prompt's request, built: its constraint compiles next
            self._compiles.submit(job)
            return
        del self._queued[job.slot]
        if request is not None and job.deadline is not None and self._clock() >= job.deadline:
            waited = self._clock() - job.arrival_time
            late = RequestTimeoutError(f"request {job.slot.request_id!r} gave no output within its timeout "
                                       f"({waited:.3g} s after it was added, still being prepared): ended")  # fmt: skip
            self._client.end_request(job.slot, *self._finals(job, late))
        elif request is not None:
            job.slot.prompt_token_ids = tuple(request.prompt_token_ids)
            self._client.add_request(request, job.slot)
        elif error is not None:
            self._client.end_request(job.slot, *self._finals(job, error))
        # else: the engine failed or shut down meanwhile; its slot already holds that error


def max_token_chars_of(tokenizer: Any) -> int | None:
    """The cheap bound on a text prompt's size (see `InputProcessor.check_text`), None without a tokenizer."""
    if tokenizer is None:
        return None
    from asyncllm.core.detokenizer import backend_tokenizer, max_token_chars

    try:
        return max_token_chars(backend_tokenizer(tokenizer))
    except AsyncLLMError:  # no fast tokenizer to read a vocabulary from: text is still checked, after tokenizing
        logger.warning("asyncllm: no vocabulary to bound text prompts by; absurd texts are refused only once tokenized")
        return None
