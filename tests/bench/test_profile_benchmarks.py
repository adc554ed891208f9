"""bench/w1_profile.py, bench/gpu_timeline.py and bench/w4_prefill.py on CPU, so the device run does not find
their bugs first: the timeline arithmetic (union, gaps, categories) on synthetic intervals, the profiler-event
readers on stand-in events shaped like torch's FunctionEvent, and both scripts end to end on the toy
`qwen3-tiny` shape (each a few seconds)."""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
from torch.autograd import DeviceType

BENCH = Path(__file__).resolve().parents[2] / "bench"
MODULES = ("gpu_timeline", "w1_profile", "w4_prefill", "w1_throughput", "shapes", "lag_trace")


@pytest.fixture(scope="module")
def bench() -> Iterator[dict[str, ModuleType]]:
    """The scripts import their neighbours as top-level modules (they run from bench/): the same here."""
    sys.path.insert(0, str(BENCH))
    try:
        yield {name: importlib.import_module(name) for name in ("gpu_timeline", "w1_profile", "w4_prefill", "shapes")}
    finally:
        sys.path.remove(str(BENCH))
        for name in MODULES:
            sys.modules.pop(name, None)


def test_union_gaps_and_histogram(bench: dict[str, ModuleType]) -> None:
    tl = bench["gpu_timeline"]
    D = tl.DeviceInterval
    events = [
        D("nvjet_tst_128x64", 0.0, 10.0),
        D("_rms_norm_kernel", 5.0, 12.0),  # overlaps the GEMM (another stream): counted once in the union
        D("_decode_split_kernel", 42.0, 50.0),  # 30 us gap
        D("Memcpy HtoD (Pinned -> Device)", 200.0, 201.0),  # 150 us gap
        D("_gumbel_partial_kernel", 1401.0, 1402.0),  # 1,200 us gap
        D("void at::native::vectorized_elementwise_kernel<4>", 1402.0, 1403.0),  # touching: no gap
    ]
    s = tl.summarize(events)
    assert s.num_events == 6
    assert s.kernel_sum_us == pytest.approx(10 + 7 + 8 + 1 + 1 + 1)
    assert s.busy_us == pytest.approx(12 + 8 + 1 + 2)
    assert s.span_us == pytest.approx(1403.0) and s.last_end_us == pytest.approx(1403.0)
    assert s.gaps_us == pytest.approx([30.0, 150.0, 1200.0])
    hist = tl.gap_histogram(s.gaps_us)
    assert hist["all"] == {"count": 3, "total_ms": 1.38}
    assert hist["gt_20us"]["count"] == 3 and hist["gt_100us"]["count"] == 2
    assert hist["gt_1ms"] == {"count": 1, "total_ms": 1.2}
    assert s.categories == {
        "gemm": (10.0, 1),
        "rms_norm": (7.0, 1),
        "decode_attention": (8.0, 1),
        "memcpy_memset": (1.0, 1),
        "sampling": (1.0, 1),
        "other": (1.0, 1),
    }
    assert tl.summarize([]).busy_us == 0.0


@pytest.mark.parametrize(
    ("name", "category"),
    [
        ("_qk_norm_rope_kv_kernel", "qk_norm_rope"),
        ("_gated_act_mul_kernel", "silu_mul"),
        ("_decode_reduce_kernel", "decode_attention"),
        ("_prefill_kernel", "prefill_attention"),
        ("_argmax_reduce_kernel", "sampling"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
        ("void cublasLt::splitKreduce_kernel<32, 16, int, float>", "gemm"),
        ("Memset (Device)", "memcpy_memset"),
        ("void at::native::index_elementwise_kernel<128, 4>", "other"),
    ],
)
def test_categories(bench: dict[str, ModuleType], name: str, category: str) -> None:
    assert bench["gpu_timeline"].categorize(name) == category


def test_split_off_moves_time_and_refuses_more_than_there_is(bench: dict[str, ModuleType]) -> None:
    tl = bench["gpu_timeline"]
    cats = {"gemm": (100.0, 10), "other": (5.0, 1)}
    assert tl.split_off(cats, "gemm", "lm_head", 30.0, 2) == {
        "gemm": (70.0, 8),
        "other": (5.0, 1),
        "lm_head": (30.0, 2),
    }
    assert cats["gemm"] == (100.0, 10)
    with pytest.raises(ValueError, match="cannot move"):
        tl.split_off(cats, "gemm", "lm_head", 130.0, 2)


def _event(name: str, device: DeviceType, start: float = 0.0, end: float = 0.0, **kw: object) -> SimpleNamespace:
    fields: dict[str, object] = dict(kernels=[], input_shapes=[], is_user_annotation=False)
    fields.update(kw)
    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end), **fields)


def test_step_kinds_cut_at_the_sampler(bench: dict[str, ModuleType]) -> None:
    iv = bench["gpu_timeline"].DeviceInterval
    events = [
        iv("_argmax_reduce_kernel", 0, 1),  # the end of a step before the trace: a boundary only
        iv("nvjet_gemm", 2, 10),
        iv("_prefill_kernel", 10, 20),
        iv("_argmax_reduce_kernel", 20, 21),  # a mixed step: 21 us from the last end, 19 busy
        iv("_decode_split_kernel", 31, 35),
        iv("_argmax_reduce_kernel", 35, 36),  # a decode step: 15 us, 5 busy
        iv("rms_norm", 40, 41),  # after the last step end: not a step
    ]
    kinds = bench["gpu_timeline"].step_kinds(events)
    assert kinds["mixed"]["steps"] == 1 and kinds["decode"]["steps"] == 1
    assert kinds["mixed"]["mean_span_us"] == 20.0 and kinds["mixed"]["mean_busy_us"] == 19.0
    assert kinds["decode"]["mean_span_us"] == 15.0 and kinds["decode"]["mean_busy_us"] == 5.0
    assert kinds["mixed"]["cat_prefill_attention_ms"] == 0.01


def test_profiler_event_readers(bench: dict[str, ModuleType]) -> None:
    """Device intervals skip CPU events and GPU-side annotations; the LM head is the GEMMs of ops that take a
    vocabulary-sized operand (not the sampler's non-GEMM kernels on the logits, not the other GEMMs)."""
    w1 = bench["w1_profile"]
    vocab = 151936
    k = SimpleNamespace
    events = [
        _event(
            "aten::mm",
            DeviceType.CPU,
            input_shapes=[[8, 1024], [1024, vocab]],
            kernels=[k(name="nvjet_a", duration=70.0)],
        ),
        _event(
            "aten::mm",
            DeviceType.CPU,
            input_shapes=[[8, 1024], [1024, 3072]],
            kernels=[k(name="nvjet_b", duration=5.0)],
        ),
        _event(
            "aten::argmax",
            DeviceType.CPU,
            input_shapes=[[8, vocab], []],
            kernels=[k(name="reduce_kernel", duration=3.0)],
        ),
        _event("cudaGraphLaunch", DeviceType.CPU),
        _event("nvjet_a", DeviceType.CUDA, 0.0, 70.0),
        _event("step", DeviceType.CUDA, 0.0, 500.0, is_user_annotation=True),
    ]
    assert w1.lm_head_gemms(events, vocab) == (70.0, 1)
    intervals = w1.device_intervals(events)
    assert [(d.name, d.start_us, d.end_us) for d in intervals] == [("nvjet_a", 0.0, 70.0)]


def test_gap_to_limit_terms_add_up(bench: dict[str, ModuleType]) -> None:
    w1 = bench["w1_profile"]
    plain = w1.RunResult(seconds=6.0, output_tokens=133_966, steps=1100)
    timeline = SimpleNamespace(busy_us=4.5e6, last_end_us=6.4e6)
    cats = {"decode_attention": (2.5e6, 28), "gemm": (1.0e6, 10), "lm_head": (0.2e6, 1), "rms_norm": (0.3e6, 5)}
    out = w1.gap_to_limit("qwen3-0.6b", plain, 6.5, timeline, cats)
    assert out["limit_wall_s"] == pytest.approx(133_966 / 36_400, abs=1e-3)
    assert sum(out["terms_s"].values()) == pytest.approx(out["over_limit_s"], abs=5e-3)
    assert out["largest_term"] == "gpu_idle"
    assert "skipped" in w1.gap_to_limit("qwen3-tiny", plain, 6.5, timeline, cats)
    truncated = SimpleNamespace(busy_us=2.0e6, last_end_us=3.0e6)  # kineto stopped recording half-way
    assert "stops before the run ends" in w1.gap_to_limit("qwen3-0.6b", plain, 6.5, truncated, cats)["skipped"]


def test_w4_prefill_rates(bench: dict[str, ModuleType]) -> None:
    """GEMM FLOPs are 2 x linear parameters x n; attention gets the rest of the per-token FLOPs x n."""
    w4, shape = bench["w4_prefill"], bench["shapes"].SHAPES["qwen3-0.6b"]
    n = 32768
    gemm = 2 * w4.linear_params(shape) * n
    attention = w4.prefill_flops_per_token(shape, n) * n - gemm
    categories = {
        "gemm": (gemm / 400e12 * 1e6, 7),  # us at 400 TFLOP/s
        "prefill_attention": (attention / 200e12 * 1e6, 28),
        "rms_norm": (500.0, 57),
    }
    rates = w4.prefill_rates(categories, shape, n)
    assert rates["gemm"]["tflops"] == 400.0 and rates["gemm"]["kernels"] == 7
    assert rates["prefill_attention"]["tflops"] == 200.0
    assert rates["other_ms"] == {"rms_norm": 0.5}


def test_w4_limit_reproduces_perf_md(bench: dict[str, ModuleType]) -> None:
    """PERF.md: prefill of Qwen3-0.6B at 32K is compute-bound at ~170K tok/s; 1.19 GB of weights per step."""
    w4, shape = bench["w4_prefill"], bench["shapes"].SHAPES["qwen3-0.6b"]
    assert w4.H200_BF16_FLOPS / w4.prefill_flops_per_token(shape, 32768) == pytest.approx(170_000, rel=0.01)
    assert w4.decode_bytes_per_token(shape, 0) == pytest.approx(1.19e9, rel=0.01)


def _needs_tokenizer(bench: dict[str, ModuleType]) -> None:
    try:
        bench["shapes"].find_qwen3_tokenizer()
    except FileNotFoundError as e:
        pytest.skip(str(e))


def _json_lines(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_w1_profile_runs_on_cpu(bench: dict[str, ModuleType], monkeypatch, capsys, tmp_path: Path) -> None:
    _needs_tokenizer(bench)
    argv = ["w1_profile.py", "--shape", "qwen3-tiny", "--device", "cpu", "--num-seqs", "2", "--max-tokens-cap", "4"]
    monkeypatch.setattr("sys.argv", argv)
    monkeypatch.setenv("OUT", str(tmp_path))
    bench["w1_profile"].main()
    lines = _json_lines(capsys.readouterr().out)
    assert [line["run"] for line in lines] == ["plain", *["profiled"] * 5, "gap_to_limit"]
    assert lines[0]["output_tokens"] == 8 and lines[1]["engine_steps"] == lines[0]["engine_steps"]
    assert lines[1]["prefix_cache_hit_rate_before_after"] == [0.0, 0.0]  # the profiled pass is not a cached replay
    assert "aten::" in (tmp_path / "w1_profile_key_averages.txt").read_text()


@pytest.mark.slow
def test_w4_prefill_runs_on_cpu(bench: dict[str, ModuleType], monkeypatch, capsys) -> None:
    _needs_tokenizer(bench)
    argv = ["w4_prefill.py", "--shape", "qwen3-tiny", "--device", "cpu", "--lengths", "96", "200"]
    argv += ["--output-tokens", "4", "--budgets", "64", "256", "--repeats", "2"]
    monkeypatch.setattr("sys.argv", argv)
    bench["w4_prefill"].main()
    lines = _json_lines(capsys.readouterr().out)
    assert len(lines) == 5
    chunked = next(r for r in lines[:4] if r.get("max_num_batched_tokens") == 64 and r["prompt_tokens"] == 200)
    assert chunked["prefill_chunks"] == 4 and chunked["engine_steps_per_request"] == [4 + 3, 4 + 3]
    assert chunked["prefix_cached_tokens"] == [0, 0] and len(chunked["ttft_ms"]) == 2
    assert set(lines[4]["chunking"]["200"]["ttft_best_ms"]) == {"64", "256"}


def test_lag_trace_names_what_blocked_the_loop(bench: dict[str, ModuleType]) -> None:
    """bench/lag_trace.py (w2_stream.py --lag-trace): a callback that blocks the loop for 40 ms is one stall
    of about that length, the loop's sampled stack names the callback, and a collection meanwhile is timed."""
    import asyncio
    import gc
    import time

    lag_trace = importlib.import_module("lag_trace").lag_trace

    def blocking_callback() -> None:
        gc.collect()
        time.sleep(0.04)  # releases the GIL, as a long C call might: the watchdog samples meanwhile

    async def run() -> object:
        with lag_trace(threshold_s=0.01) as trace:

            async def ticker() -> None:
                for _ in range(30):
                    trace.beat()
                    await asyncio.sleep(0.001)

            async def block() -> None:
                await asyncio.sleep(0.01)
                blocking_callback()

            await asyncio.gather(ticker(), block())
        return trace.summary()

    summary = asyncio.run(run())
    assert summary["stalls"] >= 1 and summary["longest_stalls_ms_at_s"][0][0] >= 35  # type: ignore[index]
    stacks = [stack for _, stack in summary["stall_stacks"]]  # type: ignore[union-attr]
    assert any(s.startswith("loop: ") and "blocking_callback" in s for s in stacks), stacks
    assert summary["gc_count_by_gen"].get(2, 0) >= 1  # type: ignore[union-attr]
