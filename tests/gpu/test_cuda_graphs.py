"""CUDA graphs against eager execution, on the GPU: the same greedy tokens while requests join and leave
(1 to 37 live sequences crossing captured sizes 1, 2, 4, 8, 16, 32, 40 with padding; steps carrying prompt
chunks padded to captured token counts), with shared prefixes (cache hits) and a cache small enough to
preempt. Also: graphs are captured only where they should be."""

from __future__ import annotations

import random

import pytest
import torch

from asyncllm import LLM, SamplingParams
from asyncllm.config import DEFAULT_GRAPH_TOKENS, SchedulerConfig
from tests.fixtures.envs import serial_llm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _workload(vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """37 requests with different lengths, so the live batch shrinks through every captured size."""
    rng = random.Random(11)
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    prompts = [
        ([*shared] if i % 3 == 0 else []) + [rng.randrange(3, vocab) for _ in range(rng.randrange(2, 30))]
        for i in range(37)
    ]
    params = [SamplingParams(temperature=0, max_tokens=4 + 2 * i, ignore_eos=True) for i in range(37)]
    return prompts, params


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(num_kv_blocks=512),
        dict(num_kv_blocks=40, max_num_batched_tokens=64),  # preemption and chunked prefill
    ],
    ids=["roomy", "preempting"],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])  # gemma3: sliding-window kernels inside the graphs
@pytest.mark.usefixtures("exact_fp32")
def test_graphs_equal_eager(tiny_checkpoints, engine_args: dict, dtype: str, family: str) -> None:
    path = str(tiny_checkpoints[family])
    common = dict(device="cuda", dtype=dtype, block_size=4, max_num_seqs=40, **engine_args)
    graphs = LLM(path, **common)
    eager = LLM(path, enforce_eager=True, **common)
    assert graphs.runtime.cuda_graph_sizes == (1, 2, 4, 8, 16, 32, 40)
    budget = engine_args.get("max_num_batched_tokens", SchedulerConfig().max_num_batched_tokens)
    assert graphs.runtime.cuda_graph_token_sizes[-1] == min(DEFAULT_GRAPH_TOKENS, budget)  # LLM: prompts uncapped
    assert eager.runtime.cuda_graph_sizes == () == eager.runtime.cuda_graph_token_sizes
    prompts, params = _workload(graphs.runtime.vocab_size)
    ours = graphs.generate(prompts, params, use_tqdm=False)
    ref = eager.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in ours] == [o.token_ids for o in ref]
    stats = graphs.stats()
    assert stats["prefix_cache_hit_rate"] > 0
    if "max_num_batched_tokens" in engine_args:
        assert stats["num_preemptions"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.mark.usefixtures("exact_fp32")
def test_graphed_mixed_steps_equal_unpadded_steps(tiny_checkpoints, monkeypatch: pytest.MonkeyPatch) -> None:
    """float32: steps carrying prompt chunks, padded to a token count and replayed from its graph, give the
    tokens of the same steps run unpadded and planned per step (ASYNCLLM_CUDA_GRAPH_MAX_TOKENS=0)."""
    path = str(tiny_checkpoints["qwen3"])
    common = dict(device="cuda", dtype="float32", block_size=4, max_num_seqs=40, num_kv_blocks=512)
    graphed = LLM(path, max_num_batched_tokens=96, **common)
    monkeypatch.setenv("ASYNCLLM_CUDA_GRAPH_MAX_TOKENS", "0")
    plain = LLM(path, max_num_batched_tokens=96, **common)
    assert graphed.runtime.cuda_graph_token_sizes == (16, 32, 48, 64, 80, 96)
    assert plain.runtime.cuda_graph_token_sizes == ()
    prompts, params = _workload(graphed.runtime.vocab_size)
    ours = graphed.generate(prompts, params, use_tqdm=False)
    ref = plain.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in ours] == [o.token_ids for o in ref]


def test_steps_carrying_prompts_replay_graphs(tiny_checkpoints) -> None:
    """Prompts alone (one output token each, chunked by a 96-token budget): every engine step replays a
    graph, none runs the model eagerly."""
    from torch.profiler import ProfilerActivity, profile

    path = str(tiny_checkpoints["qwen3"])
    llm = LLM(path, device="cuda", block_size=4, max_num_seqs=40, max_num_batched_tokens=96, num_kv_blocks=512)
    prompts, _ = _workload(llm.runtime.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    steps_before = llm.stats()["num_steps"]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    steps = llm.stats()["num_steps"] - steps_before
    launches = sum(e.count for e in prof.key_averages() if e.key.startswith("cudaGraphLaunch"))
    assert launches == steps > 0


def test_torch_backend_and_cpu_stay_eager(tiny_checkpoints) -> None:
    path = str(tiny_checkpoints["qwen3"])
    assert LLM(path, device="cuda", attention_backend="torch", num_kv_blocks=64).runtime.cuda_graph_sizes == ()
    assert LLM(path, device="cpu", num_kv_blocks=64).runtime.cuda_graph_sizes == ()


def test_first_request_pays_no_compilation(tiny_checkpoints) -> None:
    """Warm-up compiled every kernel: the first request compiles no Triton kernel, and its time to first
    token is within 2x of a warm one plus 10 ms. The slack is for first-use costs that are not compiles (an
    allocator's first block, a cuBLAS handle's first workspace: run 50 saw 5.5 ms against 1.7 warm, launches
    only in its profile); a compile or a lazy graph capture costs tens to hundreds of ms."""
    import triton.knobs
    from torch.profiler import ProfilerActivity, profile

    llm = LLM(str(tiny_checkpoints["llama"]), device="cuda", num_kv_blocks=256)
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=4, ignore_eos=True)
    compiled: list[str] = []
    previous = triton.knobs.runtime.jit_post_compile_hook

    def hook(**kwargs) -> bool:
        compiled.append(str(kwargs.get("repr", "?")))
        return False

    triton.knobs.runtime.jit_post_compile_hook = hook
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:  # started before the first request: what it paid
            first = llm.generate([[5, 6, 7, 8, 9] * 7], params, use_tqdm=False)[0].metrics.time_to_first_token
            warm = min(
                llm.generate([[9, 8, 7, 6, 5] * 7], params, use_tqdm=False)[0].metrics.time_to_first_token
                for _ in range(3)
            )
    finally:
        triton.knobs.runtime.jit_post_compile_hook = previous
    assert compiled == [], f"the first request compiled {compiled}"
    if first > 2 * warm + 0.010:
        top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]
        paid = ", ".join(f"{e.key} {e.self_cpu_time_total / 1e3:.1f} ms x{e.count}" for e in top)
        pytest.fail(f"first TTFT {first * 1e3:.1f} ms vs warm {warm * 1e3:.1f} ms; host time went to: {paid}")


@pytest.mark.parametrize("max_num_seqs", [2, 40])  # 2: warm-up's own steps cannot reach every sampling path
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_serving_compiles_no_triton_kernel_after_warm_up(tiny_checkpoints, dtype: str, max_num_seqs: int) -> None:
    """Warm-up compiled every variant the steps use: mixed prefill/decode steps of every shape, chunking,
    each sampling path. A compile mid-serving stalls every stream (a JIT compile, or at best a disk load)."""
    import triton.knobs

    path = str(tiny_checkpoints["qwen3"])
    llm = LLM(path, device="cuda", dtype=dtype, block_size=4, max_num_seqs=max_num_seqs, max_num_batched_tokens=80)
    prompts, greedy = _workload(llm.runtime.vocab_size)
    prompts += [[3 + i % 50 for i in range(n)] for n in (1, 2, 15, 16, 17, 63, 64, 65, 200)]
    extra = [
        SamplingParams(temperature=0.8, seed=1, max_tokens=9),
        SamplingParams(temperature=0.7, top_k=5, max_tokens=7),
        SamplingParams(temperature=0.9, top_p=0.8, max_tokens=5),
        SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=1.2, presence_penalty=0.5, max_tokens=6),
        SamplingParams(temperature=0, logprobs=3, max_tokens=4),
    ]
    params = greedy + [extra[i % len(extra)] for i in range(len(prompts) - len(greedy))]
    compiled: list[str] = []
    previous = triton.knobs.runtime.jit_post_compile_hook

    def hook(**kwargs) -> bool:
        compiled.append(str(kwargs.get("repr", "?")))
        return False

    triton.knobs.runtime.jit_post_compile_hook = hook
    try:
        llm.generate(prompts, params, use_tqdm=False)
        llm.generate(prompts[::-1], params[::-1], use_tqdm=False)  # other batch compositions, prefix hits
    finally:
        triton.knobs.runtime.jit_post_compile_hook = previous
    assert not compiled, f"{len(compiled)} Triton compilations after warm-up: {compiled[:5]}"


@pytest.mark.parametrize(
    "features",
    [
        {},
        {"ASYNCLLM_CUDA_GRAPH_SAMPLING": "1"},
        {"ASYNCLLM_CUDA_GRAPH_SAMPLING": "0", "ASYNCLLM_DECODE_FOLD_REDUCE": "0"},
    ],
    ids=["defaults", "graph-sampling", "neither"],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_overlapped_scheduling_equals_serial(
    tiny_checkpoints,
    dtype: str,
    features: dict[str, str],
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Planning step N+1 while N runs (tokens fed back on the device) gives the serial tokens exactly, with
    stops, seeded sampling, prefix hits and preemption in play; with the LM head and draw in the decode graphs
    or not, the decode reduce folded or not."""
    if dtype == "bfloat16" and features.get("ASYNCLLM_CUDA_GRAPH_SAMPLING") == "1":
        # Known issue (bench/RESULTS.md runs 70-71; docs/tuning.md): why is open, and the option is off by default.
        reason = "ASYNCLLM_CUDA_GRAPH_SAMPLING: a bf16 token differs between overlapped and serial scheduling"
        request.applymarker(pytest.mark.xfail(reason=reason, strict=False))
    for name, value in features.items():
        monkeypatch.setenv(name, value)
    path = str(tiny_checkpoints["qwen3"])
    common = dict(
        device="cuda", dtype=dtype, block_size=4, max_num_seqs=40, num_kv_blocks=48, max_num_batched_tokens=96
    )
    overlapped = LLM(path, **common)
    serial = serial_llm(path, **common)
    prompts, greedy = _workload(overlapped.runtime.vocab_size)
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=p.max_tokens, min_tokens=2) if i % 2 else p
        for i, p in enumerate(greedy)
    ]
    ours = overlapped.generate(prompts, params, use_tqdm=False)
    ref = serial.generate(prompts, params, use_tqdm=False)
    assert [(o.token_ids, o.finish_reason) for o in ours] == [(o.token_ids, o.finish_reason) for o in ref]
    assert overlapped.stats()["num_free_blocks"] == overlapped.stats()["num_total_blocks"]
