"""A model-free engine core paced like a GPU, for measuring what the front and the server cost on a CPU box.

A real `EngineCore` (scheduler, block manager, output processing, the real Qwen3 tokenizer's incremental
detokenization) drives `PacedExecutor`: a step is submitted at once and its tokens are ready `step_ms`
later, as a device runs a step asynchronously (the host sleeps, GIL released, only when it asks for a
result early). The tokens cycle through an English text's ids, so the text streamed is real text. What
remains on the host is exactly the engine's and the server's Python work. `paced_built` is picklable
(a module-level function), so a core process can build it too.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncllm.core.engine_core import EngineCore
from asyncllm.step import ModelRunnerOutput, RuntimeInfo, SchedulerOutput

_TEXT = (
    "The engine streams every token as soon as a step has computed it, and the server writes each one to its "
    "client as a server-sent event; when a client lags, the tokens it has not read yet join one chunk. "
)


class _PacedStep:
    def __init__(self, output: ModelRunnerOutput, ready_at: float) -> None:
        self._output = output
        self._ready_at = ready_at

    def done(self) -> bool:
        return time.monotonic() >= self._ready_at

    def start(self) -> None:
        pass

    def result(self) -> ModelRunnerOutput:
        left = self._ready_at - time.monotonic()
        if left > 0:
            time.sleep(left)
        return self._output


class PacedExecutor:
    """Steps take `step_s + per_seq_s * sequences` each, one after another, as on a device; token i of a
    sequence is `ids[i % n]`."""

    def __init__(self, runtime: RuntimeInfo, ids: list[int], step_s: float, per_seq_s: float) -> None:
        self._runtime = runtime
        self._ids = ids
        self._step_s = step_s
        self._per_seq_s = per_seq_s
        self._busy_until = 0.0
        self.grammar = None

    @property
    def runtime(self) -> RuntimeInfo:
        return self._runtime

    def submit(self, scheduled: SchedulerOutput) -> _PacedStep:
        ids, n = self._ids, len(self._ids)
        sampled = [ids[seq.seq_len % n] for seq in scheduled.seqs if seq.sample]
        seconds = self._step_s + self._per_seq_s * len(scheduled.seqs)
        self._busy_until = max(time.monotonic(), self._busy_until) + seconds
        return _PacedStep(ModelRunnerOutput(sampled_token_ids=sampled), self._busy_until)

    def shutdown(self) -> None:
        pass

    def watch_failure(self, callback: Callable[[BaseException], None]) -> None:
        pass


@dataclass
class PacedBuilt:
    core: EngineCore
    tokenizer: Any
    runtime: RuntimeInfo
    encode: Callable[[str], list[int]] | None
    encode_batch: Callable[[list[str]], list[list[int]]] | None = None
    check_constraint: Callable[[Any], None] | None = None


def paced_built(
    tokenizer_dir: str,
    step_ms: float = 1.3,
    us_per_seq: float = 17.0,
    num_kv_blocks: int = 8192,
    max_num_seqs: int = 256,
) -> PacedBuilt:
    """The paced core with the tokenizer in `tokenizer_dir` (a Hugging Face `tokenizer.json`). The default
    pace is Qwen3-0.6B's decode on an H200 as the in-process engine streamed it (bench/RESULTS.md, issue 24:
    28.9k tok/s at 64 streams, 45.5k at 256: ~1.3 ms a step plus ~17 us a sequence)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{tokenizer_dir}/tokenizer.json")
    vocab = tok.get_vocab_size()
    runtime = RuntimeInfo(
        vocab_size=vocab,
        max_model_len=4096,
        num_kv_blocks=num_kv_blocks,
        block_size=16,
        eos_token_ids=frozenset({vocab - 1}),
        device="cpu",
        dtype="float32",
    )
    executor = PacedExecutor(runtime, tok.encode(_TEXT).ids, step_ms / 1e3, us_per_seq / 1e6)
    core = EngineCore(
        executor,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=8192,
        max_prefill_tokens_while_decoding=2048,
        enable_prefix_caching=True,
        seed=0,
        tokenizer=tok,
        clock=time.monotonic,
    )
    return PacedBuilt(core, None, runtime, functools.partial(_encode, tok))


def _encode(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text).ids)
