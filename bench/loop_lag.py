"""Event-loop lag under load: how late a 1 ms ticker on the caller's loop wakes while the engine works.

Two workloads on an `AsyncLLMEngine` around the real engine core with a device-like executor (each step
sleeps --step-ms with the GIL released, as a step thread waiting on a GPU does, then returns tokens): 512
text prompts of ~1,000 characters added at once (real Qwen3 tokenizer from ../shared/models when present,
else the tests' tiny one), and 256 streams running. The lag measured is the async layer's, the core's
bookkeeping's and the tokenizer's; none of it is a forward pass's. torch and transformers are imported
first, as in an engine process, so the heap a full garbage collection walks is realistic. Prints one JSON
line per workload: ticker lag p50/p99/max and the longest full collection.

python bench/loop_lag.py [--workload text|streams|both] [--no-freeze] [--no-batch-encode] [--loop uvloop]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import gc
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.fixtures: the fake core

import torch  # noqa: E402, F401  (the heap of a real engine process)
import transformers  # noqa: E402, F401
from tokenizers import Tokenizer  # noqa: E402

from asyncllm import AsyncLLMEngine, SamplingParams  # noqa: E402
from asyncllm.step import ModelRunnerOutput, ReadyStep, SchedulerOutput  # noqa: E402
from tests.fixtures.fake_core import fake_built  # noqa: E402

QWEN3 = ROOT.parent / "shared" / "models" / "qwen3-tokenizer" / "tokenizer.json"


def load_tokenizer(path: Path) -> tuple[Tokenizer, str]:
    if path.is_file():
        return Tokenizer.from_file(str(path)), path.parent.name
    import tempfile

    from asyncllm.core.detokenizer import backend_tokenizer
    from tests.fixtures.tiny_models import build_tokenizer

    return backend_tokenizer(build_tokenizer(Path(tempfile.mkdtemp()))), "tiny-bpe"


def encode_batch_of(tokenizer: Tokenizer) -> Callable[[list[str]], list[list[int]]]:
    return lambda texts: [encoding.ids for encoding in tokenizer.encode_batch(texts)]


class DeviceLikeExecutor:
    """Sleeps `step_s` per step (GIL released, like waiting on a GPU) and samples a token per sequence.
    `overlap`: `submit` returns at once and the step "runs" on a device thread (a sleep, GIL released), one
    step after another, as a GPU's stream does, so the core plans the next step while this one runs."""

    def __init__(self, runtime: Any, step_s: float, overlap: bool = False) -> None:
        self.runtime = runtime
        self._step_s = step_s
        self._device = concurrent.futures.ThreadPoolExecutor(1, "device") if overlap else None

    def execute_model(self, scheduled: SchedulerOutput) -> ModelRunnerOutput:
        time.sleep(self._step_s)
        vocab = self.runtime.vocab_size
        return ModelRunnerOutput(sampled_token_ids=[1 + s.seq_len % (vocab - 1) for s in scheduled.seqs if s.sample])

    def submit(self, scheduled: SchedulerOutput) -> Any:
        if self._device is None:
            return ReadyStep(self.execute_model(scheduled))
        return self._device.submit(self.execute_model, scheduled)  # done() and result(), as StepResult asks

    def shutdown(self) -> None:
        if self._device is not None:
            self._device.shutdown()

    def watch_failure(self, callback: Callable[[BaseException], None]) -> None:
        pass  # sleeps and counts: nothing fails between steps


class Ticker:
    """Sleeps 1 ms in a loop and records how late each wake-up is."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self._running = True

    async def run(self) -> None:
        while self._running:
            t0 = time.perf_counter()
            await asyncio.sleep(0.001)
            self.lags.append(time.perf_counter() - t0 - 0.001)

    def stop(self) -> None:
        self._running = False


class GcWatch:
    """The longest full (generation 2) collection while installed."""

    def __init__(self) -> None:
        self.longest = 0.0
        self.count = 0
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.longest = max(self.longest, time.perf_counter() - self._t0)
            self.count += 1


def text_prompts(n: int, rng: random.Random) -> list[str]:
    words = ["the", "of", "engine", "stream", "token", "batch", "cache", "loop", "request", "model", "prefix"]
    return [" ".join(rng.choice(words) for _ in range(170))[:1000] for _ in range(n)]


def make_requests(name: str, n: int) -> tuple[list[Any], SamplingParams]:
    rng = random.Random(0)
    if name == "text":
        return text_prompts(n, rng), SamplingParams(max_tokens=16, ignore_eos=True)
    prompts = [[rng.randrange(1, 1000) for _ in range(rng.randint(8, 64))] for _ in range(n)]
    return prompts, SamplingParams(max_tokens=400, ignore_eos=True)


async def workload(engine: AsyncLLMEngine, prompts: list[Any], params: SamplingParams) -> None:
    async def read(prompt: Any) -> int:
        return sum([len(c.token_ids) async for c in engine.stream(prompt, params)])

    await asyncio.gather(*(read(p) for p in prompts))


async def measure(engine: AsyncLLMEngine, name: str, n: int) -> dict[str, Any]:
    prompts, params = make_requests(name, n)  # made before the ticker runs: the load is the engine's alone
    await workload(engine, prompts[:8], params)  # warm: a serving engine has its threads and code paths going
    ticker, watch = Ticker(), GcWatch()
    tick = asyncio.create_task(ticker.run())
    await asyncio.sleep(0.2)  # a baseline before the load arrives
    gc.callbacks.append(watch)
    t0 = time.perf_counter()
    try:
        await workload(engine, prompts, params)
    finally:
        elapsed = time.perf_counter() - t0
        gc.callbacks.remove(watch)
        ticker.stop()
        await tick
    lags = ticker.lags
    return {
        "workload": name,
        "requests": n,
        "seconds": round(elapsed, 2),
        "lag_p50_ms": round(statistics.median(lags) * 1e3, 2),
        "lag_p99_ms": round(statistics.quantiles(lags, n=100)[98] * 1e3, 2),
        "lag_max_ms": round(max(lags) * 1e3, 2),
        "full_gcs": watch.count,
        "longest_full_gc_ms": round(watch.longest * 1e3, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=["text", "streams", "both"], default="both")
    parser.add_argument("--no-freeze", action="store_true", help="undo the engine's gc.freeze() after load")
    parser.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    parser.add_argument("--step-ms", type=float, default=5.0, help="device time per step (GIL released)")
    parser.add_argument("--overlap", action="store_true", help="steps run on a device thread (async scheduling)")
    parser.add_argument("--no-batch-encode", action="store_true", help="tokenize text by text (GIL held)")
    parser.add_argument("--tokenizer", type=Path, default=QWEN3, help="a tokenizer.json (default: Qwen3's)")
    args = parser.parse_args()
    tokenizer, tokenizer_name = load_tokenizer(args.tokenizer)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    built = fake_built(
        tokenizer, vocab_size=vocab, max_model_len=1024, num_kv_blocks=40_000, block_size=16, max_num_seqs=512
    )
    built.core.executor = DeviceLikeExecutor(built.runtime, args.step_ms / 1e3, args.overlap)  # type: ignore[assignment]
    if not args.no_batch_encode:  # as build.py wires it: the Rust batch call releases the GIL, encode does not
        built = dataclasses.replace(built, encode_batch=encode_batch_of(tokenizer))
    engine = AsyncLLMEngine.from_builder(lambda: built)
    if args.no_freeze:
        gc.unfreeze()
    runs = {"text": [("text", 512)], "streams": [("streams", 256)]}.get(args.workload)
    runs = runs or [("text", 512), ("streams", 256)]
    run = asyncio.run
    if args.loop == "uvloop":
        import uvloop

        run = uvloop.run
    try:
        for name, n in runs:
            result = run(measure(engine, name, n))
            result.update(tokenizer=tokenizer_name, freeze=not args.no_freeze, batch_encode=not args.no_batch_encode)
            result.update(loop=args.loop, step_ms=args.step_ms, overlap=args.overlap)
            print(json.dumps(result), flush=True)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
