"""`choose_gemm` (worker/gemm_layout.py): from timings to one shape's layout and one-row path, on CPU.

The rules: the GEMV is taken where it beats cuBLAS's best one-row time (either layout) by GEMV_MARGIN, and it
reads the plain layout; the [in, out] layout is taken for a clear win over every row count, the GEMV standing
for the plain layout at one row; a marginal GEMV counts for nothing."""

from __future__ import annotations

from asyncllm.worker.gemm_layout import GEMV_MARGIN, GemmChoice, choose_gemm

ROWS = (1, 8, 64, 256, 2048)


def _times(one_row: float, rest: float) -> dict[int, float]:
    return {m: one_row if m == 1 else rest * m for m in ROWS}


def test_a_clear_gemv_win_keeps_the_plain_layout() -> None:
    cublas = {"plain": _times(12.9, 1.0), "transposed": _times(5.2, 1.0)}  # Qwen3-0.6B o_proj's shape
    assert choose_gemm(cublas, 4.0) == GemmChoice(transposed=False, gemv=True)
    assert choose_gemm(cublas, None) == GemmChoice(transposed=True, gemv=False)  # not timed: cuBLAS decides


def test_a_marginal_gemv_counts_for_nothing() -> None:
    cublas = {"plain": _times(5.0, 1.0), "transposed": _times(6.0, 1.0)}
    assert choose_gemm(cublas, 5.0 * GEMV_MARGIN * 1.01) == GemmChoice(transposed=False, gemv=False)
    assert choose_gemm(cublas, 5.0 * GEMV_MARGIN * 0.99) == GemmChoice(transposed=False, gemv=True)


def test_transposed_winning_the_larger_rows_outweighs_a_gemv_win() -> None:
    """[in, out] twice as fast at every larger row count: worth more than the GEMV's one row."""
    cublas = {"plain": _times(6.0, 2.0), "transposed": _times(6.0, 1.0)}
    assert choose_gemm(cublas, 3.0) == GemmChoice(transposed=True, gemv=False)


def test_timings_are_not_changed() -> None:
    cublas = {"plain": _times(12.9, 1.0), "transposed": _times(5.2, 1.0)}
    choose_gemm(cublas, 4.0)
    assert cublas["plain"][1] == 12.9


def test_a_folded_op_wins_where_it_beats_every_other_one_row_path() -> None:
    """The prologue's time is the fused GEMV's less the op's own launch: it must beat both cuBLAS and the
    plain GEMV by GEMV_MARGIN; it then stands for the plain layout at one row and the plain GEMV is off."""
    cublas = {"plain": _times(5.0, 1.0), "transposed": _times(5.5, 1.0)}
    assert choose_gemm(cublas, 4.0, 3.0) == GemmChoice(transposed=False, gemv=False, prologue=True)
    assert choose_gemm(cublas, 4.0, 4.0 * GEMV_MARGIN * 1.01) == GemmChoice(transposed=False, gemv=True)
    assert choose_gemm(cublas, None, 5.0 * GEMV_MARGIN * 1.01) == GemmChoice(transposed=False, gemv=False)
    assert choose_gemm(cublas, None, 5.0 * GEMV_MARGIN * 0.99).prologue


def test_a_large_saving_does_not_outweigh_the_larger_rows() -> None:
    """A saving bigger than the GEMM itself (a negative time) counts as half cuBLAS's one-row time: [in, out]
    three times as fast at every larger row count still wins the layout, and no GEMV reads it."""
    cublas = {"plain": _times(6.0, 3.0), "transposed": _times(6.0, 1.0)}
    assert choose_gemm(cublas, None, -2.0) == GemmChoice(transposed=True, gemv=False, prologue=False)
