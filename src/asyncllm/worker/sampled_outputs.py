"""Getting a step's sampled ids (and any logprobs, of its tokens or of prompts) to the host without making the
host wait for them.

On CUDA the ids are copied into one of two pinned buffers (two: a step's copy may land while the previous
step's output is still unread) behind an event that `result()` waits on; on CPU they are ready at once.
Knows nothing of the model or of sampling.
"""

from __future__ import annotations

import torch

from asyncllm.errors import AsyncLLMError
from asyncllm.sample.logprobs import LogprobsOutput
from asyncllm.sample.prompt_logprobs import PromptLogprobsOutput
from asyncllm.step import ModelRunnerOutput, ReadyStep, StepResult
from asyncllm.worker.step_staging import PrefixViews


class SampledOutputs:
    def __init__(self, max_rows: int, device: torch.device) -> None:
        self.device = device
        pin = device.type == "cuda"
        # Two buffers, each with an event re-recorded by every step that uses it, and kept views of its rows.
        self._buffers = [PrefixViews(torch.empty(max_rows, dtype=torch.int64, pin_memory=pin)) for _ in range(2)]
        # torch's stubs leave Event's constructor and `query` unannotated
        self._events = [torch.cuda.Event() for _ in range(2)] if pin else []  # type: ignore[no-untyped-call]
        self._next = 0

    def send(
        self,
        token_ids: torch.Tensor | None,
        logprobs: LogprobsOutput | None,
        failed: dict[int, str | AsyncLLMError] | None = None,
        prompt: PromptLogprobsOutput | None = None,
        deferred: list[int] | None = None,
    ) -> StepResult:
        """Start moving `token_ids` ([S] int64 on the device; None: the step samples nothing), `logprobs` and
        the `prompt` logprobs to the host; `failed` and `deferred`, known on the host already, ride along
        (`ModelRunnerOutput.failed`, `.deferred`)."""
        if self.device.type != "cuda":
            dicts = logprobs.to_dicts() if logprobs is not None else None
            ids = token_ids.tolist() if token_ids is not None else []
            prompt_dicts = prompt.to_dicts() if prompt is not None else None
            return ReadyStep(ModelRunnerOutput(ids, dicts, failed, prompt_dicts, deferred=deferred))
        i = self._next
        self._next ^= 1
        host = self._buffers[i](token_ids.shape[0] if token_ids is not None else 0)
        if token_ids is not None:
            host.copy_(token_ids, non_blocking=True)
        if logprobs is not None:
            logprobs.to_host()
        if prompt is not None:
            prompt.to_host()
        event = self._events[i]
        event.record()
        return _DeviceStep(host, logprobs, event, failed, prompt, deferred)


class _DeviceStep:
    def __init__(
        self,
        host: torch.Tensor,
        logprobs: LogprobsOutput | None,
        event: torch.cuda.Event,
        failed: dict[int, str | AsyncLLMError] | None,
        prompt: PromptLogprobsOutput | None,
        deferred: list[int] | None = None,
    ) -> None:
        self._host = host
        self._deferred = deferred
        self._logprobs = logprobs
        self._event = event
        self._failed = failed
        self._prompt = prompt
        self._output: ModelRunnerOutput | None = None

    def done(self) -> bool:
        return self._output is not None or bool(self._event.query())  # type: ignore[no-untyped-call]

    def start(self) -> None:
        pass

    def result(self) -> ModelRunnerOutput:
        if self._output is None:
            self._event.synchronize()  # the step's one wait: for its sampled ids, never a blocking copy
            dicts = self._logprobs.to_dicts() if self._logprobs is not None else None
            prompt = self._prompt.to_dicts() if self._prompt is not None else None
            self._output = ModelRunnerOutput(self._host.tolist(), dicts, self._failed, prompt, deferred=self._deferred)
        return self._output
