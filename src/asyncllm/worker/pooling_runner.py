"""`PoolingRunner`: an embed or score engine's step on one device. Every sequence of a step is a whole input
(the scheduler admits pooling requests only whole); the forward pass (`pooling_forward.py`) gives every
token's hidden state, and each sequence is pooled into its embedding or score (`layers/pooler.py`). Nothing
is sampled, and the vectors reach the host behind an event, so `submit` returns before the device is done
(the core plans the next step meanwhile), as the generation runner's does.

Knows nothing of requests beyond the plain data the scheduler sends (a request's `PoolingParams` arrive with
it in `NewRequestData`); nothing of how the model was loaded.
"""

from __future__ import annotations

from typing import Protocol

import torch

from asyncllm.config_values import Task
from asyncllm.layers.pooler import classifier_scores, finish_embeddings, pool, row_indices, yes_no_scores
from asyncllm.pooling import PoolerSpec, PoolingMethod, PoolingParams, ScoreMethod
from asyncllm.step import ModelRunnerOutput, SchedulerOutput, StepResult


class PoolingForward(Protocol):
    """A forward pass over whole sequences: [T, hidden] states of every scheduled token, packed in order."""

    @property
    def model(self) -> torch.nn.Module: ...

    def __call__(self, scheduled: SchedulerOutput, token_type_ids: list[tuple[int, ...] | None]) -> torch.Tensor: ...

    def release(self) -> None: ...


class PoolingRunner:
    def __init__(self, forward: PoolingForward, spec: PoolerSpec, device: torch.device) -> None:
        self.forward = forward
        self.spec = spec
        self.device = device
        self.grammar = None  # what a Worker asks of any runner: no output constraints, no adapters
        self.loras = None
        self._params: dict[str, PoolingParams] = {}  # requests scheduled but not run yet

    @torch.inference_mode()
    def submit(self, scheduled: SchedulerOutput) -> StepResult:
        """Run the step's forward pass and pool each sequence; returns before the vectors reach the host."""
        for request_id in scheduled.finished_request_ids:
            self._params.pop(request_id, None)
        for new in scheduled.new_requests:
            assert new.pooling is not None, "a generation request reached an embed or score engine"
            self._params[new.request_id] = new.pooling
        seqs = scheduled.seqs
        assert all(s.sample and s.start_pos == 0 for s in seqs), "pooling sequences run whole, in one step"
        params = [self._params.pop(s.request_id) for s in seqs]  # each request is scheduled once
        hidden = self.forward(scheduled, [p.token_type_ids for p in params])  # [T, hidden]
        lens = [s.num_tokens for s in seqs]
        spec = self.spec
        if spec.task is Task.EMBED:
            values = finish_embeddings(pool(hidden, lens, spec.method), spec.normalizes, params)  # [B, H]
            widths = [p.dimensions or spec.hidden_size for p in params]
        else:
            values = self._scores(hidden, lens)[:, None]  # [B, 1]
            widths = [1] * len(seqs)
        return PooledStep(values, widths)

    def _scores(self, hidden: torch.Tensor, lens: list[int]) -> torch.Tensor:
        """[B] float32: each sequence's relevance score."""
        spec, model = self.spec, self.forward.model
        if spec.score is ScoreMethod.YES_NO:
            assert spec.yes_no_token_ids is not None
            last = hidden[row_indices(lens, PoolingMethod.LAST, hidden.device)]  # [B, hidden]
            return yes_no_scores(model.compute_logits(last), *spec.yes_no_token_ids)  # type: ignore[operator]
        assert spec.score is ScoreMethod.CLASSIFIER, spec.score
        cls = hidden[row_indices(lens, spec.method, hidden.device)]  # [B, hidden]
        return classifier_scores(model.classify(cls))  # type: ignore[operator]

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._params.pop(request_id, None)

    def shutdown(self) -> None:
        self._params.clear()
        self.forward.release()


class PooledStep:
    """A pooling step's vectors on their way to the host: row i, cut to `widths[i]` values, is sequence i's
    (`ModelRunnerOutput.pooled`). On CUDA a pinned copy behind an event; on CPU ready at once."""

    def __init__(self, values: torch.Tensor, widths: list[int]) -> None:
        self._widths = widths
        self._event: torch.cuda.Event | None = None
        if values.device.type == "cuda":
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._event.record()
        else:
            self._host = values
        self._output: ModelRunnerOutput | None = None

    def done(self) -> bool:
        return self._output is not None or self._event is None or bool(self._event.query())  # type: ignore[no-untyped-call]

    def start(self) -> None:
        pass

    def result(self) -> ModelRunnerOutput:
        if self._output is None:
            if self._event is not None:
                self._event.synchronize()
            rows = self._host.tolist()
            self._output = ModelRunnerOutput([], pooled=[row[:w] for row, w in zip(rows, self._widths)])
        return self._output
