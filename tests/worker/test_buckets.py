"""The host side of CUDA-graph replay, on CPU (`Buckets` and the padding `InputBuffers` does for them): which
sizes are captured, which shape a step runs at, what padded rows hold (no KV write, one key, positions in
range), and where a static attention plan's work list is staged."""

from __future__ import annotations

import itertools

import torch

from asyncllm.attention.backend import AttentionBackend, AttentionMetadata, AttentionPlan, PlanBounds
from asyncllm.config import EngineConfig
from asyncllm.model_loader.checkpoint import open_checkpoint
from asyncllm.step import ScheduledSeq, SchedulerOutput
from asyncllm.worker.buckets import Buckets, capture_sizes, is_decode_only, token_capture_sizes
from asyncllm.worker.device import ResolvedModel
from asyncllm.worker.input_batch import InputBuffers
from asyncllm.worker.setup import build_worker


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(37) == [1, 2, 4, 8, 16, 32, 37]
    assert capture_sizes(256) == [1, 2, 4, 8, *range(16, 257, 16)]


def test_token_capture_sizes() -> None:
    assert token_capture_sizes(12) == []  # below one bucket: such steps stay unpadded
    assert token_capture_sizes(64) == [16, 32, 48, 64]
    sizes = token_capture_sizes(2048)
    assert sizes[:8] == list(range(16, 129, 16)) and sizes[-4:] == [1280, 1536, 1792, 2048]
    assert token_capture_sizes(1000)[-2:] == [896, 1000]
    assert all(b <= a * 1.25 for a, b in itertools.pairwise(sizes[7:])), "a step pads by at most a quarter"


def test_padded_tokens_belong_to_no_sequence() -> None:
    buffers = InputBuffers(64, 8, 4, 4, torch.device("cpu"))
    step = SchedulerOutput(seqs=[ScheduledSeq("a", [11], 6, [2, 3], True), ScheduledSeq("b", [5, 6, 7], 0, [9], True)])
    x = buffers.prepare(step, pad_tokens_to=16)
    assert x.num_tokens == 16 and x.meta.num_seqs == 2
    assert x.input_ids.tolist() == [11, 5, 6, 7] + [0] * 12
    assert x.meta.slot_mapping.tolist() == [3 * 4 + 2, 36, 37, 38] + [-1] * 12  # padding writes no KV
    assert x.meta.query_start_loc.tolist() == [0, 1, 4] and x.meta.seq_lens.tolist() == [7, 3]
    assert x.meta.query_lens_cpu == [1, 3] and x.logits_indices.tolist() == [0, 3]
    padded = buffers.prepare(step, pad_logits_to=4)  # the LM head's padded row count repeats the last row
    assert padded.logits_indices.tolist() == [0, 3, 3, 3] and padded.num_tokens == 4


def test_only_decode_steps_replay() -> None:
    decode = SchedulerOutput(seqs=[ScheduledSeq("a", [3], 5, [0, 1], True)])
    chunk = SchedulerOutput(seqs=[ScheduledSeq("a", [3, 4], 5, [0, 1], True)])
    middle = SchedulerOutput(seqs=[ScheduledSeq("a", [3], 5, [0, 1], False)])  # a one-token chunk, no sample
    assert is_decode_only(decode) and not is_decode_only(chunk) and not is_decode_only(middle)


def test_padded_rows_write_nothing_and_attend_one_key() -> None:
    buffers = InputBuffers(64, 8, 4, 4, torch.device("cpu"))
    step = SchedulerOutput(seqs=[ScheduledSeq("a", [11], 6, [2, 3], True), ScheduledSeq("b", [12], 9, [5, 6, 7], True)])
    x = buffers.prepare(step, pad_to=4)
    assert x.num_tokens == 4 and x.meta.num_seqs == 4
    assert x.input_ids.tolist() == [11, 12, 0, 0]
    assert x.positions.tolist() == [6, 9, 0, 0]
    assert x.meta.slot_mapping.tolist() == [3 * 4 + 2, 7 * 4 + 1, -1, -1]  # position 9: block_ids[2], row 1
    assert x.meta.seq_lens.tolist() == [7, 10, 1, 1]
    assert x.meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert x.meta.block_tables[2:].abs().sum().item() == 0
    assert x.logits_indices.tolist() == [0, 1]  # only real rows sample
    again = buffers.prepare(SchedulerOutput(seqs=[ScheduledSeq("a", [13], 7, [2, 3], True)]))  # no padding
    assert again.num_tokens == 1 and again.meta.slot_mapping.tolist() == [3 * 4 + 3]


def test_block_table_rows_follow_owners_growth_and_preemption() -> None:
    """Rows are rewritten only when they change; a preempted (or finished, id reused) request that comes back
    in its old row with new blocks must not keep the old ones."""
    buffers = InputBuffers(64, 4, 6, 4, torch.device("cpu"))

    def table(step: SchedulerOutput) -> list[list[int]]:
        return buffers.prepare(step).meta.block_tables.tolist()

    a, b = ScheduledSeq("a", [1], 5, [3, 4], True), ScheduledSeq("b", [2], 1, [7], True)
    assert table(SchedulerOutput(seqs=[a, b])) == [[3, 4, 0, 0, 0, 0], [7, 0, 0, 0, 0, 0]]
    a2 = ScheduledSeq("a", [1], 8, [3, 4, 9], True)  # grew a block
    assert table(SchedulerOutput(seqs=[a2, b])) == [[3, 4, 9, 0, 0, 0], [7, 0, 0, 0, 0, 0]]
    assert table(SchedulerOutput(seqs=[b])) == [[7, 0, 0, 0, 0, 0]]  # rows follow the batch order
    back = ScheduledSeq("b", [2, 2, 2], 0, [11, 12], True)  # b preempted, resumed with other blocks
    step = SchedulerOutput(seqs=[back], preempted_request_ids=["b"])
    assert table(step) == [[11, 12, 0, 0, 0, 0]]
    reused = ScheduledSeq("b", [5], 0, [13], True)  # b finished; a new request reuses the id
    assert table(SchedulerOutput(seqs=[reused], finished_request_ids=["b"])) == [[13, 0, 0, 0, 0, 0]]


def test_decode_sizes_fit_the_token_budget(tiny_model) -> None:
    """Regression: sizes up to max_num_seqs were captured even when the step's token budget was smaller, and
    the input buffers (sized by the budget) overflowed during capture."""
    import pytest

    pytest.importorskip("triton")
    buckets = _buckets(tiny_model, attention_backend="triton", max_num_batched_tokens=12)
    assert buckets.decode_sizes == [1, 2, 4, 8, 12]
    assert buckets.token_sizes == []  # a 12-token budget is below the smallest mixed-step bucket
    # The LM head pads the sampled rows to those buckets (warm-up ran each), never past the largest.
    assert [buckets.logit_rows(n) for n in (1, 3, 5, 9, 12)] == [1, 4, 8, 12, 12]


def test_token_sizes_follow_the_budget_and_the_graph_limit(tiny_model, monkeypatch) -> None:
    """Mixed steps pad up to min(ASYNCLLM_CUDA_GRAPH_MAX_TOKENS, max_num_batched_tokens); 0 turns padding off,
    and the torch reference backend never pads."""
    import pytest

    pytest.importorskip("triton")

    def token_sizes(graph_max_tokens: str = "auto", **kwargs) -> list[int]:
        monkeypatch.setenv("ASYNCLLM_CUDA_GRAPH_MAX_TOKENS", graph_max_tokens)
        return _buckets(tiny_model, **kwargs).token_sizes

    assert token_sizes(attention_backend="triton", max_num_batched_tokens=64) == [16, 32, 48, 64]
    assert token_sizes("48", attention_backend="triton", max_num_batched_tokens=512) == [16, 32, 48]
    assert token_sizes("0", attention_backend="triton") == []
    assert token_sizes(attention_backend="torch") == []


def _buckets(path, **kwargs) -> Buckets:
    """The buckets of a CPU worker built for the tiny model with these engine arguments."""
    config = EngineConfig.from_kwargs(str(path), device="cpu", num_kv_blocks=16, **kwargs)
    checkpoint = open_checkpoint(str(path), torch.float32)
    worker = build_worker(config, checkpoint, ResolvedModel.resolve(config, checkpoint.hf_config))
    assert worker.runner is not None
    return worker.runner.buckets


class _StaticBackend(AttentionBackend):
    """A backend that plans statically: its work list is the step's sequence lengths, padded to the bounds."""

    name = "static"
    supports_cuda_graphs = True

    def plan(self, meta: AttentionMetadata, bounds: PlanBounds | None = None) -> _LensPlan:
        pad = [] if bounds is None else [-1] * (bounds.max_seqs - meta.num_seqs)
        return _LensPlan(meta.seq_lens_cpu + pad)

    def work_size(self, bounds: PlanBounds) -> int:
        return bounds.max_seqs

    def attend(self, q, k_cache, v_cache, meta, scale):  # type: ignore[no-untyped-def]
        raise NotImplementedError


class _LensPlan(AttentionPlan):
    def __init__(self, work: list[int]) -> None:
        self.work = work
        self.device: torch.Tensor | None = None

    def bind(self, work: torch.Tensor) -> None:
        self.device = work


def test_buckets_pick_the_shape_a_step_runs_at() -> None:
    """Decode-only steps pad to a batch bucket and use their hidden rows as they are; other steps pad to a
    token bucket and gather their sampled rows; steps past the largest bucket run unpadded, planned alone."""
    buckets = Buckets.for_engine(
        _StaticBackend(), max_num_seqs=8, max_num_tokens=64, max_graph_tokens=32, max_seq_len=99
    )
    assert buckets.decode_sizes == [1, 2, 4, 8] and buckets.token_sizes == [16, 32]
    decode = SchedulerOutput(seqs=[ScheduledSeq(r, [1], 3, [0], True) for r in "abc"])
    shape = buckets.shape(decode, 3)
    assert shape is buckets.shape(decode, 3), "decode shapes are made once"
    assert (shape.graph, shape.pad_to, shape.pad_tokens_to, shape.logit_rows) == (("decode", 4), 4, None, 4)
    assert shape.bounds == PlanBounds(4, 4, 99, decode_only=True) and not shape.gathers_logits
    mixed = SchedulerOutput(seqs=[ScheduledSeq("a", [1] * 20, 0, [0, 1], True), ScheduledSeq("b", [1], 3, [2], True)])
    shape = buckets.shape(mixed, 2)
    assert (shape.graph, shape.pad_to, shape.pad_tokens_to, shape.pad_logits_to) == (("mixed", 32), None, 32, 2)
    assert shape.bounds == PlanBounds(32, 8, 99)
    large = SchedulerOutput(seqs=[ScheduledSeq("a", [1] * 40, 0, [0, 1, 2], True)])
    shape = buckets.shape(large, 1)
    assert shape.graph is None and shape.bounds is None and shape.pad_tokens_to is None and shape.pad_logits_to == 1


def test_a_static_plan_is_staged_at_one_fixed_address_and_sent_with_the_inputs() -> None:
    """The backend hands its work list over as host ints; the worker writes it into the `work` region (the
    address a captured graph reads) and it reaches the device only with the step's one flush."""
    backend = _StaticBackend()
    buckets = Buckets.for_engine(backend, max_num_seqs=4, max_num_tokens=16, max_graph_tokens=0, max_seq_len=32)
    buffers = InputBuffers(16, 4, 4, 4, torch.device("cpu"), buckets.work_room())
    addresses = set()
    for lens in ([2, 4], [1, 3, 4]):
        step = SchedulerOutput(seqs=[ScheduledSeq(f"r{i}", [7], n - 1, [i], True) for i, n in enumerate(lens)])
        shape = buckets.shape(step, len(lens))
        x = buffers.prepare(step, shape.pad_to, shape.pad_tokens_to, shape.pad_logits_to, flush=False)
        buffers.stage_plan(x.meta, backend.plan(x.meta, shape.bounds), static=True)
        plan = x.meta.plan
        assert isinstance(plan, _LensPlan) and plan.device is not None
        addresses.add(plan.device.data_ptr())
        padded = lens + [1] * (shape.logit_rows - len(lens))  # padding sequences attend to one key
        assert plan.device.tolist() != padded, "the device side changed before the flush"
        buffers.flush()
        assert plan.device.tolist() == padded
    assert len(addresses) == 1


def test_a_new_request_gets_its_own_row_whatever_ran_under_its_id_before() -> None:
    """Regression: warm-up's and capture's dummy sequences ("warmup-0", "capture-0") left their block-table
    rows owned under their ids, and a row is rewritten only when its owner or block count changes: a user's
    request of the same id, landing on that row with as many blocks or more, kept the dummy's first blocks
    (its attention read block 0's keys). A new request's row is written whole."""
    from asyncllm.sampling_params import SamplingParams
    from asyncllm.step import NewRequestData

    buffers = InputBuffers(64, 8, 4, 4, torch.device("cpu"))
    buffers.prepare(SchedulerOutput(seqs=[ScheduledSeq("capture-0", [1], 0, [0], True)]))  # a dummy, never finished
    new = NewRequestData("capture-0", [5, 6, 7, 8, 9], SamplingParams(), seed=0)
    step = SchedulerOutput(seqs=[ScheduledSeq("capture-0", [5, 6, 7, 8, 9], 0, [6, 2], True)], new_requests=[new])
    x = buffers.prepare(step)
    assert x.meta.block_tables[0, :2].tolist() == [6, 2]


def test_a_sequence_placed_again_on_a_row_it_left_gets_its_blocks_written() -> None:
    """Regression: a sequence that moved to a lower row (the one ahead of it finished) still owned the row it
    left; preempted and resumed with other blocks, or its id reused by a new request, and placed on that row
    again, it kept the row's older blocks. Each owner holds one row."""
    from asyncllm.sampling_params import SamplingParams
    from asyncllm.step import NewRequestData

    for comes_back in ("preempted", "reused"):
        buffers = InputBuffers(64, 8, 4, 4, torch.device("cpu"))
        buffers.prepare(
            SchedulerOutput(seqs=[ScheduledSeq("a", [1], 0, [1], True), ScheduledSeq("b", [2], 4, [3, 4], True)])
        )
        buffers.prepare(SchedulerOutput(seqs=[ScheduledSeq("b", [2], 5, [3, 4], True)], finished_request_ids=["a"]))
        if comes_back == "preempted":
            buffers.prepare(SchedulerOutput(seqs=[ScheduledSeq("c", [5], 0, [9], True)], preempted_request_ids=["b"]))
            step = SchedulerOutput(seqs=[ScheduledSeq("c", [5], 1, [9], True), ScheduledSeq("b", [2], 5, [6, 7], True)])
        else:
            new = [NewRequestData(i, [5], SamplingParams(), seed=0) for i in ("c", "b")]
            seqs = [ScheduledSeq("c", [5], 0, [9], True), ScheduledSeq("b", [2, 3, 4, 5, 6], 0, [6, 7], True)]
            step = SchedulerOutput(seqs=seqs, finished_request_ids=["b"], new_requests=new)
        x = buffers.prepare(step)
        assert x.meta.block_tables[1, :2].tolist() == [6, 7], comes_back
