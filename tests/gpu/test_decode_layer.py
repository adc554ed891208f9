"""The persistent decode layer (kernels/decode_layer.py) on the GPU, where its grid barriers run with a program on
every SM (bench/gpu_check.sh runs it; skipped without CUDA): against decode_layer_ref in each dtype at every
row count it takes, lengths from one key to thousands (one split or many merging), padding rows; a hundred
launches back to back (the barrier and tickets reused); a CUDA graph replayed with other lengths. The
interpreter's tests (tests/kernels/test_decode_layer.py) check each phase's arithmetic, not memory ordering."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from asyncllm import LLM, SamplingParams
from tests.fixtures.triton_kernels import TOLERANCE
from tests.kernels.decode_layer_cases import LayerCase, make_case

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

QWEN3_06B = dict(hidden=1024, heads=16, kv_heads=8, dim=128, inter=3072)


@pytest.fixture(scope="module")
def dl():
    from asyncllm.kernels import decode_layer

    return decode_layer


def check(dl, case: LayerCase, scratch, dtype: torch.dtype, **launch) -> None:
    ref_k, ref_v = case.k_cache.clone(), case.v_cache.clone()
    want, want_h1 = dl.decode_layer_ref(*case.with_caches(ref_k, ref_v).args()[:-1], case.seq_lens, 0.088)
    k, v = case.k_cache.clone(), case.v_cache.clone()
    got, got_h1 = dl.decode_layer(*case.with_caches(k, v).args(), 0.088, scratch, **launch)
    torch.cuda.synchronize()
    live = [i for i, n in enumerate(case.seq_lens) if n > 0]
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got_h1[live], want_h1[live], atol=tol, rtol=tol)
    torch.testing.assert_close(got[live], want[live], atol=tol, rtol=tol)
    torch.testing.assert_close(k, ref_k, atol=tol, rtol=tol)
    torch.testing.assert_close(v, ref_v, atol=tol, rtol=tol)
    assert not scratch.tickets.any() and not scratch.barrier[1:].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8, 16])
def test_matches_ref(dl, dtype: torch.dtype, rows: int) -> None:
    rng = random.Random(rows)
    lens = [rng.choice([1, 2, 17, 128, 129, 700, 3000]) for _ in range(rows)]
    case = make_case(lens, **QWEN3_06B, dtype=dtype, device="cuda", seed=rows)
    check(dl, case, dl.DecodeLayerScratch(case.w, rows, torch.device("cuda")), dtype)


@pytest.mark.parametrize("qk_norm,residual", [(False, True), (True, False)])
def test_llama_form_and_first_layer(dl, qk_norm: bool, residual: bool) -> None:
    case = make_case([300, 5], **QWEN3_06B, qk_norm=qk_norm, residual=residual, dtype=torch.bfloat16, device="cuda")
    check(dl, case, dl.DecodeLayerScratch(case.w, 2, torch.device("cuda")), torch.bfloat16)


def test_padding_rows(dl) -> None:
    case = make_case([0, 900, 0, 3], **QWEN3_06B, dtype=torch.bfloat16, device="cuda", seed=5)
    check(dl, case, dl.DecodeLayerScratch(case.w, 4, torch.device("cuda")), torch.bfloat16)


def test_hundred_launches_back_to_back(dl) -> None:
    """Every launch's barriers and merges reuse the same counters: a reset race would hang or mix rounds."""
    case = make_case([2000], **QWEN3_06B, dtype=torch.bfloat16, device="cuda", seed=9)
    scratch = dl.DecodeLayerScratch(case.w, 1, torch.device("cuda"))
    first, _ = dl.decode_layer(*case.with_caches(case.k_cache.clone(), case.v_cache.clone()).args(), 0.088, scratch)
    outs = [dl.decode_layer(*case.with_caches(case.k_cache.clone(), case.v_cache.clone()).args(), 0.088, scratch)[0]
            for _ in range(100)]  # fmt: skip
    torch.cuda.synchronize()
    for out in outs:
        torch.testing.assert_close(out, first, atol=0, rtol=0)  # one order of sums: the same bits every time
    assert not scratch.tickets.any() and not scratch.barrier[1:].any()


@pytest.mark.parametrize("rows", [1, 4])
def test_prefetch_modes_change_no_bit(dl, rows: int) -> None:
    """Asking L2 for the weights (every PREFETCH_MODES way, and the next layer's qkv) is a hint: each gives the
    bits of none, at lengths that take one split and many."""
    from asyncllm.kernels.decode_layer_plan import PREFETCH_MODES

    case = make_case([3000, 1, 129, 40][:rows], **QWEN3_06B, dtype=torch.bfloat16, device="cuda", seed=13)
    scratch = dl.DecodeLayerScratch(case.w, rows, torch.device("cuda"))
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    outs = {}
    for mode in PREFETCH_MODES:
        config = dl.plan_config(case.w, rows, programs, prefetch=mode)
        k, v = case.k_cache.clone(), case.v_cache.clone()
        outs[mode] = (*dl.decode_layer(*case.with_caches(k, v).args(), 0.088, scratch, config=config), k, v)
    config = dl.plan_config(case.w, rows, programs, prefetch="ahead")
    k, v = case.k_cache.clone(), case.v_cache.clone()
    next_qkv = torch.randn_like(case.w.qkv)  # another layer's: asked for, never read
    outs["ahead, next layer"] = (
        *dl.decode_layer(*case.with_caches(k, v).args(), 0.088, scratch, config=config, next_qkv=next_qkv),
        k,
        v,
    )
    torch.cuda.synchronize()
    for mode, got in outs.items():
        for name, a, b in zip(("out", "h1", "k", "v"), got, outs["off"]):
            torch.testing.assert_close(a, b, atol=0, rtol=0, msg=lambda m, mode=mode, name=name: f"{mode} {name}: {m}")
    check(dl, case, scratch, torch.bfloat16, config=dl.plan_config(case.w, rows, programs, prefetch="ahead"))


@pytest.mark.parametrize("rows", [1, 4])
def test_with_and_without_preload_matches_ref(dl, rows: int) -> None:
    """With `preload` (the default: weights double-buffered in registers, each phase's first step and the first
    attention item's first key tile loaded during the barrier ahead of them) and without, at the planned K steps
    and at small ones (tiles of several steps), lengths of one key tile a split and of many (the preloaded tile
    merged with the rest)."""
    case = make_case([3000, 1, 129, 40][:rows], **QWEN3_06B, dtype=torch.bfloat16, device="cuda", seed=17)
    scratch = dl.DecodeLayerScratch(case.w, rows, torch.device("cuda"))
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    for preload in (True, False):
        for step_bytes in (32 << 10, 2 << 10):
            for splits in (None, 1):
                config = dl.plan_config(case.w, rows, programs, step_bytes=step_bytes, preload=preload)
                check(dl, case, scratch, torch.bfloat16, config=config, num_splits=splits)


@pytest.mark.parametrize("rows", [1, 4])
def test_preload_equals_none_in_float32(dl, rows: int) -> None:
    """bf16's tolerance would hide one stale key among 3,000; in float32 the two forms differ only by where the
    preloaded key tile's softmax state merges with the rest (~1e-7), so one wrong key (~1e-4 here) shows."""
    case = make_case([3000, 1, 129, 40][:rows], **QWEN3_06B, dtype=torch.float32, device="cuda", seed=19)
    scratch = dl.DecodeLayerScratch(case.w, rows, torch.device("cuda"))
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    got = {}
    for preload in (True, False):
        k, v = case.k_cache.clone(), case.v_cache.clone()
        config = dl.plan_config(case.w, rows, programs, preload=preload)
        got[preload] = (*dl.decode_layer(*case.with_caches(k, v).args(), 0.088, scratch, config=config), k, v)
    torch.cuda.synchronize()
    for name, a, b in zip(("out", "h1", "k", "v"), got[True], got[False]):
        tol = 0.0 if name in ("k", "v") else 1e-5  # the new keys and values: the same arithmetic
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=lambda m, name=name: f"{name}: {m}")


def test_cuda_graph_replays_other_lengths(dl) -> None:
    case = make_case([3000, 3000, 3000], **QWEN3_06B, dtype=torch.bfloat16, device="cuda", seed=11)
    scratch = dl.DecodeLayerScratch(case.w, 3, torch.device("cuda"))
    args = list(case.args())
    seq_lens = args[-1]
    dl.decode_layer(*args, 0.088, scratch)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, h1 = dl.decode_layer(*args, 0.088, scratch)
    tol = TOLERANCE[torch.bfloat16]
    for lens in ([3000, 1, 640], [7, 2999, 128], [0, 3000, 1]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        case.positions.copy_(torch.tensor([max(n - 1, 0) for n in lens]))
        table = case.block_tables.tolist()
        slots = [table[r][(n - 1) // 16] * 16 + (n - 1) % 16 if n > 0 else -1 for r, n in enumerate(lens)]
        case.slot_mapping.copy_(torch.tensor(slots))
        k_before, v_before = case.k_cache.clone(), case.v_cache.clone()
        graph.replay()
        torch.cuda.synchronize()
        want, want_h1 = dl.decode_layer_ref(*case.with_caches(k_before, v_before).args()[:-1], lens, 0.088)
        live = [i for i, n in enumerate(lens) if n > 0]
        torch.testing.assert_close(out[live], want[live], atol=tol, rtol=tol, msg=lambda m, lens=lens: f"{lens}: {m}")
        torch.testing.assert_close(h1[live], want_h1[live], atol=tol, rtol=tol)
        torch.testing.assert_close(case.k_cache, k_before, atol=tol, rtol=tol)
        torch.testing.assert_close(case.v_cache, v_before, atol=tol, rtol=tol)


@pytest.mark.usefixtures("exact_fp32")
def test_engine_gives_the_chain_tokens(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ASYNCLLM_DECODE_LAYER=1 (float32, CUDA graphs): five requests finishing at different steps, so decode
    steps of 5 down to 2 rows replay the chain's graphs and the last request's steps the one-launch graph of
    size 1; the tokens of the chain alone."""
    outputs, switched = [], []
    for on in ("1", "0"):
        monkeypatch.setenv("ASYNCLLM_DECODE_LAYER", on)
        llm = LLM(str(tiny_model), device="cuda", dtype="float32", max_model_len=512)
        try:
            rng, vocab = random.Random(3), llm.runtime.vocab_size
            prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(20, 300))] for _ in range(5)]
            params = [SamplingParams(temperature=0, max_tokens=8 + 6 * i, ignore_eos=True) for i in range(5)]
            outputs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
            switched.append(llm.runtime.decode_layers)
        finally:
            llm.shutdown()
    assert outputs[0] == outputs[1]
    assert switched[0] > 0 and switched[1] == 0, switched
