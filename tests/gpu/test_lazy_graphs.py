"""ASYNCLLM_CUDA_GRAPH_CAPTURE=lazy on the GPU: start-up captures the largest graph of each kind, and each other
bucket's graph is captured by the first step that needs it (run eagerly, then recorded) or, in an async engine,
while it idles. The same tokens as graphs captured at start-up and as eager steps, while the live batch crosses
every bucket (those first steps and the replays after them); once every bucket was met, every step replays a
graph."""

from __future__ import annotations

import pytest
import torch

from asyncllm import LLM, SamplingParams
from tests.gpu.test_cuda_graphs import _workload

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

_COMMON = dict(device="cuda", block_size=4, max_num_seqs=40, num_kv_blocks=512, max_num_batched_tokens=96)


@pytest.mark.parametrize("sampling_graphs", ["0", "1"], ids=["eager-draw", "graph-sampling"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.usefixtures("exact_fp32")
def test_lazy_capture_equals_capture_at_start_and_eager(
    tiny_checkpoints, dtype: str, sampling_graphs: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tiny_checkpoints["qwen3"])
    monkeypatch.setenv("ASYNCLLM_CUDA_GRAPH_SAMPLING", sampling_graphs)
    at_start = LLM(path, dtype=dtype, **_COMMON)
    eager = LLM(path, dtype=dtype, enforce_eager=True, **_COMMON)
    monkeypatch.setenv("ASYNCLLM_CUDA_GRAPH_CAPTURE", "lazy")
    lazy = LLM(path, dtype=dtype, **_COMMON)
    assert lazy.runtime.cuda_graph_sizes == at_start.runtime.cuda_graph_sizes == (1, 2, 4, 8, 16, 32, 40)
    assert lazy.runtime.cuda_graph_token_sizes == at_start.runtime.cuda_graph_token_sizes
    prompts, params = _workload(lazy.runtime.vocab_size)
    first = [o.token_ids for o in lazy.generate(prompts, params, use_tqdm=False)]  # captures as it goes
    again = [o.token_ids for o in lazy.generate(prompts, params, use_tqdm=False)]  # replays them
    ref = [o.token_ids for o in at_start.generate(prompts, params, use_tqdm=False)]
    assert first == again == ref
    if dtype == "float32":
        assert ref == [o.token_ids for o in eager.generate(prompts, params, use_tqdm=False)]


def test_lazy_graphs_replay_once_captured(tiny_checkpoints, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same requests twice, without the prefix cache (whose hits would plan the second pass's steps apart):
    in the first pass the steps that capture their bucket's graph run it eagerly (fewer graph launches than
    steps: the captures are lazy), and in the second every step replays a graph."""
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setenv("ASYNCLLM_CUDA_GRAPH_CAPTURE", "lazy")
    llm = LLM(str(tiny_checkpoints["qwen3"]), enable_prefix_caching=False, **_COMMON)
    prompts, _ = _workload(llm.runtime.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)  # prompt steps, then decode buckets
    counts = []
    for _ in range(2):
        steps_before = llm.stats()["num_steps"]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate(prompts, params, use_tqdm=False)
        launches = sum(e.count for e in prof.key_averages() if e.key.startswith("cudaGraphLaunch"))
        counts.append((launches, llm.stats()["num_steps"] - steps_before))
    (first, first_steps), (again, again_steps) = counts
    assert first < first_steps and again == again_steps > 0, counts


@pytest.mark.usefixtures("exact_fp32")
def test_idle_engine_captures_the_pending_graphs(tiny_checkpoints, monkeypatch: pytest.MonkeyPatch) -> None:
    """An async engine with lazy capture captures the graphs start-up left while it idles
    (`stats()["cuda_graphs_pending"]` falls to 0), over dummy rows that write no KV: the prefix cache that the
    first pass filled serves the second pass, and both give a start-up capture's tokens; then every step
    replays a graph."""
    import asyncio

    from torch.profiler import ProfilerActivity, profile

    from asyncllm import AsyncLLMEngine

    path = str(tiny_checkpoints["qwen3"])
    monkeypatch.setenv("ASYNCLLM_CUDA_GRAPH_SAMPLING", "0")  # one graph launch a step (no draw graph)
    at_start = LLM(path, dtype="float32", **_COMMON)
    prompts, params = _workload(at_start.runtime.vocab_size)
    ref = [o.token_ids for o in at_start.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setenv("ASYNCLLM_CUDA_GRAPH_CAPTURE", "lazy")

    async def run(engine: AsyncLLMEngine, ids: str) -> list[list[int]]:
        # The ids of capture's (and warm-up's) dummy rows: a request of such an id gets its own block table.
        requests = (engine.generate(p, s, request_id=f"{ids}-{i}") for i, (p, s) in enumerate(zip(prompts, params)))
        outputs = await asyncio.gather(*requests)
        return [o.outputs[0].token_ids for o in outputs]

    async def main() -> dict[str, object]:
        async with AsyncLLMEngine(path, dtype="float32", **_COMMON) as engine:
            seen: dict[str, object] = {"pending_at_start": engine.runtime.cuda_graphs_pending}
            seen["first"] = await run(engine, "warmup")  # beside the idle captures, or capturing buckets itself
            deadline = asyncio.get_running_loop().time() + 120
            while engine.stats()["cuda_graphs_pending"] and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            before = engine.stats()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                seen["second"] = await run(engine, "capture")
            after = engine.stats()
            seen["launches"] = sum(e.count for e in prof.key_averages() if e.key.startswith("cudaGraphLaunch"))
            seen["steps"] = after["num_steps"] - before["num_steps"]
            seen["hits"] = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
            seen["pending"] = after["cuda_graphs_pending"]
            return seen

    seen = asyncio.run(main())
    assert seen["pending_at_start"] > 0 and seen["pending"] == 0, seen
    assert seen["first"] == ref and seen["second"] == ref
    assert seen["hits"] > 0  # the first pass's blocks, kept through the idle captures
    assert seen["launches"] == seen["steps"] > 0, seen
