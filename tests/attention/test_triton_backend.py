"""The Triton backend against the torch reference backend: mixed steps (decode, prefill, chunked prefill in
one batch) over a real paged cache, then the whole engine's greedy output with either backend.

Without CUDA the kernels run in Triton's CPU interpreter (float32; see tests/fixtures/triton_kernels.py).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from asyncllm import LLM, SamplingParams
from asyncllm.attention.backend import PlanBounds
from asyncllm.attention.torch_ref import TorchAttentionBackend
from asyncllm.config_values import AttentionBackendName
from tests.fixtures.paged import PagedBatcher
from tests.fixtures.triton_kernels import DEVICE, HAS_CUDA, TOLERANCE, import_paged_attention

needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


@pytest.fixture(scope="module")
def kernels():
    return import_paged_attention()


def _backend(dtype: torch.dtype, num_kv_heads: int, kv_dtype: torch.dtype | None = None):
    from asyncllm.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend(DEVICE, dtype, num_kv_heads, kv_dtype)


def _to_device(meta):
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        setattr(meta, name, getattr(meta, name).to(DEVICE))
    return meta


def _compare_steps(
    steps: list[list[tuple[int, int]]],
    block_size: int,
    group: int,
    head_dim: int,
    dtype,
    graph_tokens: int = 0,
    graph_decode: bool = False,
    window: int | None = None,
    kv_dtype: torch.dtype | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    """Runs each step's (seq_id, new tokens) through both backends, each with its own cache; outputs and
    caches must agree after every step. `graph_tokens`: the Triton side plans every step for one CUDA-graph
    shape of that many rows (queries padded with rows of no sequence), as a captured mixed step replays.
    `graph_decode`: decode-only steps are planned as a captured decode graph replays them. `window`: both
    attend as a sliding-window layer. `kv_dtype`: the caches' (float8_e4m3fn: an FP8 cache, with `kv_scales`)."""
    gen = torch.Generator().manual_seed(block_size * group)
    num_kv_heads, scale = 2, head_dim**-0.5
    # Room for the longest steps (about 2,300 tokens over six sequences) at every block size.
    batcher = PagedBatcher(num_blocks=max(64, 4096 // block_size), block_size=block_size, seed=group)
    [(k_ref, v_ref), (k_tri, v_tri)] = [
        (k.to(DEVICE), v.to(DEVICE)) for k, v in batcher.new_caches(2, num_kv_heads, head_dim, kv_dtype or dtype)
    ]
    torch_backend, triton_backend = TorchAttentionBackend(), _backend(dtype, num_kv_heads, kv_dtype)
    scales = [torch.tensor(s, device=DEVICE) for s in kv_scales]
    # A static plan's work list at one fixed address, as the worker keeps it (a captured graph reads it there).
    work = torch.zeros(triton_backend.work_size(PlanBounds(max(graph_tokens, 64), 9, 4096)), dtype=torch.int32)
    work = work.to(DEVICE)
    launches = set()
    for chunks in steps:
        _, meta = batcher.step(chunks)
        meta = _to_device(meta)
        num_tokens = sum(n for _, n in chunks)
        q = torch.randn(num_tokens, num_kv_heads * group, head_dim, generator=gen).to(dtype).to(DEVICE)
        k, v = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE) for _ in "kv")
        torch_backend.plan_and_upload(meta)
        expected = torch_backend.forward(q, k, v, k_ref, v_ref, meta, scale, window, *scales)
        if graph_tokens:
            triton_backend.plan_and_upload(meta, PlanBounds(graph_tokens, 9, 4096), into=work)
            plan = meta.plan
            launches.add(
                (plan.num_splits, plan.prefill_programs, plan.decode_seqs.data_ptr(), plan.prefill_tiles.data_ptr())
            )
            pad = torch.randn(graph_tokens - num_tokens, *q.shape[1:], generator=gen).to(dtype).to(DEVICE)
            out = triton_backend.forward(torch.cat([q, pad]), k, v, k_tri, v_tri, meta, scale, window, *scales)
            assert out[num_tokens:].eq(0).all(), "padding rows are zero, never garbage"
            out = out[:num_tokens]
        elif graph_decode and num_tokens == len(chunks):
            triton_backend.plan_and_upload(meta, PlanBounds(num_tokens, num_tokens, 4096, decode_only=True), into=work)
            launches.add((meta.plan.num_splits, meta.plan.decode_seqs.data_ptr()))
            lens = meta.seq_lens_cpu  # programs start longest first (ties in batch order): the last wave is short
            assert meta.plan.decode_seqs.tolist() == sorted(range(len(lens)), key=lambda i: (-lens[i], i))
            out = triton_backend.forward(q, k, v, k_tri, v_tri, meta, scale, window, *scales)
        else:
            triton_backend.plan_and_upload(meta)
            out = triton_backend.forward(q, k, v, k_tri, v_tri, meta, scale, window, *scales)
        assert not out.isnan().any(), "a query row was left unwritten"
        torch.testing.assert_close(out, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
        assert torch.equal(k_tri.view(torch.uint8), k_ref.view(torch.uint8)), "stored keys differ"
    assert len(launches) <= 1, f"one captured shape, but the launches changed between steps: {launches}"


# step 1 prefills a few sequences (one in two chunks), step 2 mixes decodes, a new prompt and the second chunk
MIXED_STEPS = [
    [(0, 17), (1, 1), (2, 40), (3, 16)],
    [(0, 1), (1, 1), (2, 23), (4, 5), (3, 1)],
    [(0, 1), (1, 2), (2, 1), (4, 1), (5, 1)],
]
# then a prompt beside five decodes, then eight two-token prompts beside a decode: more prefill tiles than a
# 96-row graph's prefill programs, which stride over them
LONGER_STEPS = [
    *MIXED_STEPS,
    [(6, 30), (0, 1), (1, 1), (4, 9), (7, 2), (8, 1)],
    [(i, 2) for i in range(9, 17)] + [(6, 1)],
]


@pytest.mark.parametrize("block_size,group,head_dim", [(16, 2, 64), (32, 1, 24), (16, 8, 32), (4, 2, 16)])
@pytest.mark.slow
def test_mixed_steps_match_torch_backend(kernels, block_size: int, group: int, head_dim: int) -> None:
    _compare_steps(MIXED_STEPS, block_size, group, head_dim, torch.float32)


@pytest.mark.parametrize("block_size,group,head_dim", [(16, 2, 64), (4, 8, 16)])
@pytest.mark.slow
def test_graph_planned_steps_match_torch_backend(kernels, block_size: int, group: int, head_dim: int) -> None:
    """Steps of 5 to 74 tokens in up to 9 sequences, each planned for one 96-row, 9-sequence graph shape:
    the same launches every step (shapes and work-list addresses), the reference's outputs."""
    _compare_steps(LONGER_STEPS, block_size, group, head_dim, torch.float32, graph_tokens=96)


@pytest.mark.slow
def test_graph_planned_decode_steps_match_torch_backend(kernels) -> None:
    """Decode steps planned as a captured decode graph replays them: the work list is rewritten each step in
    its own order (longest first: 2, 0, 3, 1 here, then changed by a prefill), the launch stays the same."""
    prefill = [(0, 17), (1, 3), (2, 40), (3, 16)]
    decode = [(0, 1), (1, 1), (2, 1), (3, 1)]
    steps = [prefill, decode, decode, [(1, 60)], decode]
    _compare_steps(steps, 16, 2, 64, torch.float32, graph_decode=True)


@pytest.mark.parametrize("window", [1, 7, 20])
@pytest.mark.slow
def test_sliding_window_steps_match_torch_backend(kernels, window: int) -> None:
    """A sliding-window layer's steps, eager: windows of the query alone, inside a prefill tile of 16 rows,
    and across tiles."""
    _compare_steps(LONGER_STEPS, 4, 2, 16, torch.float32, window=window)


@pytest.mark.slow
def test_sliding_window_graph_planned_steps_match_torch_backend(kernels) -> None:
    """The same steps planned as a captured mixed step, and decode steps as a captured decode step, the window
    across tiles (the window's own split count is fixed by the bounds: one launch shape throughout). A plan
    sets the grid, its padding and the split count, the window only the kernels' masks: each width is the
    eager test's."""
    _compare_steps(LONGER_STEPS, 16, 2, 16, torch.float32, graph_tokens=96, window=20)
    decode = [(0, 1), (1, 1), (2, 1), (3, 1)]
    _compare_steps([[(0, 17), (1, 3), (2, 40), (3, 16)], decode, decode], 16, 2, 16, torch.float32, graph_decode=True,
                   window=20)  # fmt: skip


@pytest.mark.slow
def test_fp8_cache_steps_match_torch_backend(kernels) -> None:
    """An e4m3 cache with scales other than 1: both backends store the same codes and read them alike, eagerly,
    planned as a captured mixed step and as a captured decode step, globally and in a sliding window."""
    fp8 = dict(kv_dtype=torch.float8_e4m3fn, kv_scales=(0.37, 1.55))
    _compare_steps(MIXED_STEPS, 16, 2, 64, torch.float32, **fp8)
    _compare_steps(LONGER_STEPS, 4, 2, 16, torch.float32, graph_tokens=96, window=7, **fp8)
    decode = [(0, 1), (1, 1), (2, 1), (3, 1)]
    _compare_steps([[(0, 17), (1, 3), (2, 40), (3, 16)], decode, decode], 16, 2, 16, torch.float32, graph_decode=True,
                   **fp8)  # fmt: skip


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_gpu_mixed_steps_match_torch_backend(kernels, dtype: torch.dtype, block_size: int) -> None:
    long_steps = [[(0, 300), (1, 1), (2, 1000)], [(0, 1), (1, 700), (2, 1), (3, 129)], [(i, 1) for i in range(4)]]
    _compare_steps(MIXED_STEPS + long_steps, block_size, 2, 128, dtype)
    _compare_steps(MIXED_STEPS + long_steps, block_size, 2, 128, dtype, graph_tokens=1536)
    _compare_steps(MIXED_STEPS + long_steps, block_size, 2, 128, dtype, window=512)
    _compare_steps(MIXED_STEPS + long_steps, block_size, 2, 128, dtype, graph_tokens=1536, window=100)
    fp8 = dict(kv_dtype=torch.float8_e4m3fn, kv_scales=(0.37, 1.55))
    _compare_steps(MIXED_STEPS + long_steps, block_size, 2, 128, dtype, graph_tokens=1536, **fp8)
    _compare_steps(MIXED_STEPS + long_steps, block_size, 2, 128, dtype, window=100, **fp8)


def _greedy(
    path: Path, backend: str, device: str, lengths: tuple[int, ...] = (3, 21, 40), max_tokens: int = 6, **engine_args
) -> list[list[int]]:
    llm = LLM(str(path), device=device, dtype="float32", attention_backend=backend, **engine_args)
    assert llm.runtime.attention_backend == backend
    rng = random.Random(5)
    prompts = [[rng.randrange(3, llm.runtime.vocab_size) for _ in range(n)] for n in lengths]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_total_blocks"]
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
@pytest.mark.slow
def test_engine_greedy_equals_torch_backend_in_interpreter(kernels, tiny_checkpoints, family: str) -> None:
    """The whole engine on CPU with the interpreted kernels (chunked prefill forced by the token budget): every
    fused kernel in its family's form, and Gemma 3's 8-key sliding windows."""
    if HAS_CUDA:
        pytest.skip("covered on CUDA by test_engine_greedy_equals_torch_backend_on_cuda")
    path = tiny_checkpoints[family]
    # The interpreter's time grows with the tokens (a program per token and KV head for the fused q/k/v
    # kernel): prompts as short as still cross blocks (4) and the window (8), one longer than the step's
    # budget (chunked over two steps, the second mixed with the other's decode), and a few decode steps.
    args = dict(block_size=4, num_kv_blocks=128, max_num_batched_tokens=8, lengths=(3, 13), max_tokens=4)
    assert _greedy(path, "triton", "cpu", **args) == _greedy(path, "torch", "cpu", **args)


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
@pytest.mark.slow
def test_engine_fp8_cache_greedy_equals_torch_backend_in_interpreter(kernels, tiny_checkpoints, family: str) -> None:
    """kv_cache_dtype="fp8" with the interpreted kernels: the fused KV write's codes and the kernels' reads
    against the torch backend's store and read of the same codes (Gemma 3: its sliding windows, its q/k norm
    form), chunked prefill included."""
    if HAS_CUDA:
        pytest.skip("covered on CUDA by tests/gpu/test_kv_cache_fp8.py")
    path = tiny_checkpoints[family]
    args = dict(block_size=4, num_kv_blocks=128, max_num_batched_tokens=8, lengths=(3, 13), max_tokens=4)
    assert _greedy(path, "triton", "cpu", kv_cache_dtype="fp8", **args) == _greedy(
        path, "torch", "cpu", kv_cache_dtype="fp8", **args
    )


@pytest.mark.gpu
@needs_cuda
@pytest.mark.usefixtures("exact_fp32")
@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama", "llama3", "mistral", "mistral_swa", "gemma3"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_engine_greedy_equals_torch_backend_on_cuda(kernels, tiny_checkpoints, family: str, block_size: int) -> None:
    args = dict(block_size=block_size, num_kv_blocks=128, max_num_batched_tokens=32)
    path = tiny_checkpoints[family]
    assert _greedy(path, "triton", "cuda", **args) == _greedy(path, "torch", "cuda", **args)


def test_cpu_without_interpreter_is_refused_with_the_fix(kernels, monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncllm.attention.registry import make_attention_backend

    monkeypatch.setattr(kernels, "runs_in_interpreter", lambda: False)
    with pytest.raises(ValueError, match=r"needs a CUDA device.*attention_backend='torch'.*TRITON_INTERPRET=1"):
        make_attention_backend(AttentionBackendName.TRITON, torch.device("cpu"), torch.float32, 2)
    assert make_attention_backend(AttentionBackendName.AUTO, torch.device("cpu"), torch.float32, 2).name == "torch"
