"""The persistent decode layer (`decode_layer`) against its specification, `decode_layer_ref`, in the CPU
interpreter (float32): every phase's partition over several programs (one launch a phase: the interpreter runs
programs one after another, so a grid barrier would wait forever), the one-launch form with its barriers at one
program, rows with and without the residual and q/k norms, rows whose keys span one split or many (the merge),
padding rows, and the caches' new keys. tests/gpu/test_decode_layer.py runs the barriers with every SM."""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.triton_kernels import TOLERANCE, import_kernel
from tests.kernels.decode_layer_cases import LayerCase, make_case

SHAPE = dict(hidden=64, heads=4, kv_heads=2, dim=16, inter=96)  # GQA 2, as Qwen3-0.6B


@pytest.fixture(scope="module")
def dl():
    return import_kernel("decode_layer")


def guarded(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, view): the cache between a block of NaN on either side, which no store may touch."""
    guard = torch.full_like(cache[:1], float("nan"))
    buf = torch.cat([guard, cache, guard])
    return buf, buf[1:-1]


def run_both(dl, case: LayerCase, cache_tol: float | None = None, **launch) -> None:
    """decode_layer and the reference on their own copies of the caches; outputs, residual and caches agree
    (caches within `cache_tol`, default the dtype's tolerance), and nothing is stored outside the caches."""
    ref_k, ref_v = case.k_cache.clone(), case.v_cache.clone()
    out_ref, h1_ref = dl.decode_layer_ref(*case.with_caches(ref_k, ref_v).args()[:-1], case.seq_lens, 0.25)
    scratch = dl.DecodeLayerScratch(case.w, max(len(case.seq_lens), launch.pop("max_rows", 1)), case.x.device)
    for call in range(2):  # twice: the tickets and the barrier are left ready for the next launch
        (k_buf, k), (v_buf, v) = guarded(case.k_cache), guarded(case.v_cache)
        round_before = int(scratch.barrier[0])
        out, h1 = dl.decode_layer(*case.with_caches(k, v).args(), 0.25, scratch, **launch)
        if not launch.get("phases"):  # four barriers, each one round
            assert int(scratch.barrier[0]) == round_before + 4, "a barrier was skipped or passed twice"
        assert k_buf[0].isnan().all() and k_buf[-1].isnan().all() and v_buf[0].isnan().all() and v_buf[-1].isnan().all()
        live = [i for i, n in enumerate(case.seq_lens) if n > 0]
        tol = TOLERANCE[case.x.dtype]
        for name, got, want in (("h1", h1, h1_ref), ("out", out, out_ref)):
            msg = f"call {call} {name}"
            torch.testing.assert_close(got[live], want[live], atol=tol, rtol=tol, msg=lambda m, msg=msg: f"{msg}: {m}")
        ctol = tol if cache_tol is None else cache_tol
        torch.testing.assert_close(k, ref_k, atol=ctol, rtol=ctol)
        torch.testing.assert_close(v, ref_v, atol=ctol, rtol=ctol)
        assert not scratch.tickets.any(), "a merge left its ticket counter set"
        assert not scratch.barrier[1:].any(), "a barrier left arrivals counted"


@pytest.mark.parametrize("seq_lens", [[1], [37], [5, 70, 1], [130, 3, 17, 64]])
def test_phase_by_phase_over_programs_equals_ref(dl, seq_lens: list[int]) -> None:
    """Three programs share every phase; 4 splits make rows of 37+ keys merge partials, short ones not."""
    run_both(dl, make_case(seq_lens, **SHAPE, seed=len(seq_lens)), programs=3, num_splits=4, phases=True)


@pytest.mark.parametrize("qk_norm,residual", [(True, True), (False, False), (True, False)])
def test_one_launch_equals_ref(dl, qk_norm: bool, residual: bool) -> None:
    """The GPU's form: every phase in one launch, the barriers between them (one program here)."""
    case = make_case([45, 9], **SHAPE, qk_norm=qk_norm, residual=residual, seed=7)
    run_both(dl, case, num_splits=3)


@pytest.mark.parametrize("preload", [True, False])
@pytest.mark.parametrize("seq_lens,splits", [([37, 5], 2), ([70, 100], 1)])
@pytest.mark.parametrize("phases,programs", [(True, 3), (False, 1)])
def test_small_steps_equal_ref(
    dl, phases: bool, programs: int, seq_lens: list[int], splits: int, preload: bool
) -> None:
    """Small K steps give each program several tiles of several steps: without `preload` each step loads its
    own; with it (the default) a step's weights are asked for during the one before, and must cross from one
    tile to the next (and from the last step of one phase's loop to nothing), the first step before the
    phase's barrier; a program's first attention item's first key tile comes before barrier 1, and the new key
    falls in it (37 keys in splits of 32) or past it (70 and 100 keys, one split: the tile merged with the rest)."""
    case = make_case(seq_lens, **SHAPE, seed=11)
    config = dl.plan_config(case.w, 2, programs, step_bytes=256, preload=preload)
    assert config.bk_qkv < SHAPE["hidden"] and config.bk_down < SHAPE["inter"], "one K step a tile: nothing crosses"
    run_both(dl, case, programs=programs, num_splits=splits, phases=phases, config=config)


@pytest.mark.parametrize("programs", [3, 4])
def test_preload_keeps_the_cached_key_of_a_row_without_slot(dl, programs: int) -> None:
    """A live row with slot -1 (nothing stored) whose last key falls in a preloaded tile: the cache's key stands
    (the new one from registers only where the launch stores it)."""
    case = make_case([37, 5], **SHAPE, seed=11)
    case.slot_mapping[0] = -1
    config = dl.plan_config(case.w, 2, programs, step_bytes=256, preload=True)
    run_both(dl, case, programs=programs, num_splits=2, phases=True, config=config)


def test_preload_with_programs_beyond_the_items_and_tiles(dl) -> None:
    """More programs than attention items (1 row x 2 KV heads x 1 split) and than some phases' tiles: a program
    with none preloads nothing it uses."""
    case = make_case([37], **SHAPE, seed=12)
    run_both(dl, case, programs=4, num_splits=1, phases=True, config=dl.plan_config(case.w, 1, 4, preload=True))


def test_padding_rows_store_nothing(dl) -> None:
    """A CUDA graph's padding rows (length 0, slot -1) write no key and leave the real rows exact."""
    run_both(dl, make_case([0, 33, 0], **SHAPE, seed=3), programs=2, num_splits=2, phases=True, max_rows=4)


def test_float16_rounds_where_the_separate_kernels_do(dl) -> None:
    """In float32 every rounding to the activations' dtype is a no-op; in float16 the new keys and values (norms,
    rotary: each product rounded) must be the reference's to the bit."""
    case = make_case([21, 40], **SHAPE, dtype=torch.float16, seed=4)
    run_both(dl, case, cache_tol=0.0, programs=2, num_splits=2, phases=True)


def test_bad_inputs_are_refused(dl) -> None:
    case = make_case([5, 6], **SHAPE)
    scratch = dl.DecodeLayerScratch(case.w, 1, case.x.device)
    with pytest.raises(ValueError, match="rows"):
        dl.decode_layer(*case.args(), 0.25, scratch)
    scratch = dl.DecodeLayerScratch(case.w, 2, case.x.device)
    with pytest.raises(ValueError, match="num_splits"):
        dl.decode_layer(*case.args(), 0.25, scratch, num_splits=0)
    bad = make_case([5, 6], **SHAPE)
    bad.positions = bad.positions.to(torch.int32)
    with pytest.raises(ValueError, match="positions"):
        dl.decode_layer(*bad.args(), 0.25, scratch)
    with pytest.raises(ValueError, match="max_rows"):
        dl.DecodeLayerScratch(case.w, 17, case.x.device)
    other = make_case([5, 6], **{**SHAPE, "inter": 32})
    with pytest.raises(ValueError, match="scratch was made for"):
        dl.decode_layer(*other.args(), 0.25, scratch)
    args = list(case.args())
    args[7] = args[7][:, :4]  # sin_cache of half the width
    with pytest.raises(ValueError, match="sin_cache"):
        dl.decode_layer(*args, 0.25, scratch)
    args = list(case.args())
    args[9] = torch.cat([args[9], args[9]], dim=1)[:, ::2]  # the same values, columns strided
    with pytest.raises(ValueError, match="block_tables"):
        dl.decode_layer(*args, 0.25, scratch)
    config = dl.plan_config(case.w, 2, 1)
    with pytest.raises(ValueError, match="config's o tile"):
        dl.decode_layer(*case.args(), 0.25, scratch, config=dl.DecodeLayerConfig(**{**vars(config), "bn_o": 128}))
    with pytest.raises(ValueError, match="CUDA only"):
        dl.decode_layer(*case.args(), 0.25, scratch, config=dl.DecodeLayerConfig(**vars(config) | {"prefetch": "bulk"}))
    with pytest.raises(ValueError, match="next_qkv must be a contiguous"):
        dl.decode_layer(*case.args(), 0.25, scratch, next_qkv=case.w.qkv)  # prefetch off: nothing would ask for it
    with pytest.raises(ValueError, match=r"prefetch_pieces=0 must be in \[1, 128\]"):
        no_pieces = dl.DecodeLayerConfig(**vars(config) | {"prefetch_pieces": 0})
        dl.decode_layer(*case.args(), 0.25, scratch, config=no_pieces)
    with pytest.raises(ValueError, match="prefetch='early' is not one of"):
        dl.plan_config(case.w, 2, 1, prefetch="early")
    with pytest.raises(ValueError, match="config's prefetch True is not one of"):
        dl.decode_layer(*case.args(), 0.25, scratch, config=dl.DecodeLayerConfig(**{**vars(config), "prefetch": True}))


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA tests/gpu/test_decode_layer.py compiles and runs it")
def test_kernel_compiles_for_hopper_without_a_gpu() -> None:
    """Triton's compiler (not the interpreter) builds the one-launch form, barriers included, for sm_90 at the
    tiles the launcher plans for Qwen3-0.6B and -8B (tests/kernels/hopper_compile_decode_layer.py)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("hopper_compile_decode_layer.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert out.stdout.count("ok ") == 8, out.stdout
