"""Overlapped scheduling against serial scheduling: the engine core plans step N+1 while step N is "on the
device" (an asynchronous FakeExecutor runs a step only when its result is asked for), feeding N's tokens in
as placeholders. Stops (EOS, stop ids, stop strings), max_tokens, min_tokens and aborts must land exactly
where the serial engine puts them: same tokens, same text, same finish reasons, nothing streamed past an
end, every block freed once."""

from __future__ import annotations

import random

import pytest

from asyncllm.core.detokenizer import backend_tokenizer
from asyncllm.core.engine_core import EngineCore
from asyncllm.core.output_processor import RequestDelta
from asyncllm.input_processor import InputProcessor
from asyncllm.sampling_params import SamplingParams
from asyncllm.step import PLACEHOLDER
from tests.core.invariants import check_block_invariants
from tests.fixtures.fake_executor import FakeExecutor, hash_next_token, make_engine_core, make_runtime
from tests.fixtures.tiny_models import build_tokenizer

EOS = 0


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory):
    return backend_tokenizer(build_tokenizer(tmp_path_factory.mktemp("tok")))


def _engine(tok, overlap: bool, **limits) -> tuple[EngineCore, FakeExecutor, InputProcessor]:
    runtime = make_runtime(
        vocab_size=tok.get_vocab_size(), num_kv_blocks=40, block_size=4, eos_token_ids=frozenset({EOS})
    )
    executor = FakeExecutor(runtime, next_token=_often_eos(tok.get_vocab_size()), asynchronous=overlap)
    core = make_engine_core(executor, tokenizer=tok, **limits)
    return core, executor, InputProcessor(runtime, lambda s: tok.encode(s).ids)


def _often_eos(vocab: int):
    """A hash of the sequence, EOS about one time in twelve: requests stop at different points."""
    token = hash_next_token(vocab)

    def next_token(tokens) -> int:  # type: ignore[no-untyped-def]
        t = token(tokens)
        return EOS if t % 12 == 0 else t

    return next_token


def _workload(seed: int) -> list[tuple[str, SamplingParams]]:
    rng = random.Random(seed)
    texts = ["The capital of France", "Hello world! 日本語", "def add(a, b):", "café naïve Zürich"]
    out = []
    for i in range(14):
        kind = i % 5
        params = [
            SamplingParams(max_tokens=rng.randint(1, 30)),  # length or EOS
            SamplingParams(max_tokens=40, stop=[rng.choice(["e", "a", " ", "o"])]),  # stop strings
            SamplingParams(max_tokens=25, stop_token_ids=[rng.randrange(1, 384)], include_stop_str_in_output=True),
            SamplingParams(max_tokens=20, min_tokens=6),  # EOS before 6 tokens is not a stop
            SamplingParams(max_tokens=35, ignore_eos=True, stop=["ab", "c"]),
        ][kind]
        out.append((rng.choice(texts) * rng.randint(1, 3), params))
    return out


def _run(core: EngineCore, executor: FakeExecutor, aborts: dict[int, list[str]] | None = None) -> dict:
    """Step to the end; `aborts` maps a step number to ids aborted before it. Returns per request: tokens,
    text, reason; checks invariants every step and that nothing follows a final delta."""
    out: dict[str, dict] = {}
    aborts = aborts or {}

    def take(delta: RequestDelta | None) -> None:
        if delta is None:
            return
        entry = out.setdefault(delta.request_id, {"tokens": [], "text": "", "reason": None})
        assert entry["reason"] is None, f"{delta.request_id} streamed after it ended"
        entry["tokens"] += delta.new_token_ids
        entry["text"] += delta.new_text
        entry["reason"] = delta.finish_reason

    for step in range(2000):
        for rid in aborts.get(step, []):
            take(core.abort_request(rid))
        if not core.has_unfinished():
            break
        for delta in core.step():
            take(delta)
        check_block_invariants(core.block_manager, core.scheduler.requests.values())
    assert not core.has_unfinished()
    stats = core.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("budget", [7, 64])
def test_overlap_gives_the_serial_outputs(tok, seed: int, budget: int) -> None:
    results = []
    for overlap in (False, True):
        core, executor, ip = _engine(tok, overlap, max_num_batched_tokens=budget, max_num_seqs=6)
        for i, (prompt, params) in enumerate(_workload(seed)):
            core.add_request(ip.make_request(f"r{i}", prompt, params, 0.0))
        results.append(_run(core, executor))
        if overlap:
            assert any(s.takes_previous_token for step in executor.steps for s in step.seqs), "never overlapped"
    assert results[0] == results[1]
    assert {r["reason"] for r in results[0].values()} >= {"stop", "length"}


def test_a_request_stopped_at_step_n_streams_nothing_from_step_n_plus_1(tok) -> None:
    """The step after a stop was already planned (and computed) with the stopped request in it: its token
    is dropped, the stream ends at the stop, and the runner hears the request finished."""
    core, executor, ip = _engine(tok, True)
    core.add_request(ip.make_request("a", [5, 6, 7], SamplingParams(max_tokens=150), 0.0))
    result = _run(core, executor)["a"]
    assert result["reason"] == "stop" and result["tokens"][-1] == EOS
    computed = sum(1 for step in executor.steps for s in step.seqs if s.request_id == "a" and s.sample)
    assert computed == len(result["tokens"]) + 1  # one speculative step past the EOS, discarded
    assert executor.known_requests <= set(core.scheduler.pending_finished_ids)  # told with the next step


def test_no_step_is_planned_past_max_tokens(tok) -> None:
    """With its last token in flight a request is not scheduled again: no wasted step at max_tokens."""
    core, executor, ip = _engine(tok, True)
    core.add_request(ip.make_request("a", [5, 6, 7], SamplingParams(max_tokens=9, ignore_eos=True), 0.0))
    result = _run(core, executor)["a"]
    assert result["reason"] == "length" and len(result["tokens"]) == 9
    assert sum(1 for step in executor.steps for s in step.seqs if s.request_id == "a" and s.sample) == 9


def test_aborts_while_a_step_is_in_flight_land_exactly(tok) -> None:
    """Aborted between steps, with that request's step in flight: the abort is the stream's last chunk, no
    token of the in-flight step follows, its blocks are freed once, and the others equal the serial run."""
    serial_core, serial_exec, ip = _engine(tok, False, max_num_seqs=6)
    for core in (serial_core,):
        for i, (prompt, params) in enumerate(_workload(9)):
            core.add_request(ip.make_request(f"r{i}", prompt, params, 0.0))
    reference = _run(serial_core, serial_exec)
    aborts = {3: ["r1", "r4"], 5: ["r7"], 6: ["r8", "r1"], 9: ["r12"]}
    core, executor, ip = _engine(tok, True, max_num_seqs=6)
    for i, (prompt, params) in enumerate(_workload(9)):
        core.add_request(ip.make_request(f"r{i}", prompt, params, 0.0))
    got = _run(core, executor, aborts)
    aborted = {rid for ids in aborts.values() for rid in ids}
    for rid, entry in got.items():
        if rid in aborted and entry["reason"] == "abort":
            assert entry["tokens"] == reference[rid]["tokens"][: len(entry["tokens"])]
            assert reference[rid]["text"].startswith(entry["text"])
        else:
            assert entry == reference[rid]
    assert any(got[rid]["reason"] == "abort" for rid in aborted)


def test_placeholders_are_only_ever_a_last_input(tok) -> None:
    core, executor, ip = _engine(tok, True, max_num_batched_tokens=5)
    for i, (prompt, params) in enumerate(_workload(2)):
        core.add_request(ip.make_request(f"r{i}", prompt, params, 0.0))
    _run(core, executor)
    for step in executor.steps:
        for seq in step.seqs:
            assert PLACEHOLDER not in seq.input_token_ids[:-1]
            if seq.takes_previous_token:
                assert seq.num_tokens == 1 and seq.sample
