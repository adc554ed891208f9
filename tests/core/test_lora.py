"""LoRA adapters in the engine core, over a FakeExecutor whose "KV" is marked with each request's adapter: every
request gets its own adapter's tokens with adapters, and none, mixed in batches, chunked, preempted and
overlapped; prefix hits never cross adapters (nor a removed adapter's namesake); a batch never mixes more than
`max_loras` adapters (the fake checks every step), and a request whose adapter finds no slot waits its turn;
adding and removing refuse what they must, naming it, and change nothing then."""

from __future__ import annotations

import random

import pytest

from asyncllm.core.output_processor import RequestDelta
from asyncllm.errors import InvalidRequestError, LoRAError
from asyncllm.input_processor import InputProcessor
from asyncllm.sampling_params import SamplingParams
from tests.fixtures.fake_executor import FakeExecutor, kv_token, make_engine_core, make_runtime, reference_tokens


def _setup(max_loras: int = 2, **runtime_kwargs: int):
    runtime = make_runtime(max_loras=max_loras, **runtime_kwargs)
    executor = FakeExecutor(runtime)
    return executor, InputProcessor(runtime, None)


def _run(core, max_steps: int = 2000) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not core.has_unfinished():
            return tokens
        for delta in core.step():
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    raise AssertionError("requests did not finish")


def _expected(executor: FakeExecutor, prompt: list[int], max_tokens: int, lora_id: int) -> list[int]:
    def next_token(tokens):
        return executor.next_token([kv_token(t, lora_id) for t in tokens])

    return reference_tokens(next_token, prompt, max_tokens, frozenset({0}))


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("num_kv_blocks", [64, 14])  # 14: preemptions
def test_each_request_gets_its_own_adapters_tokens(async_scheduling: bool, num_kv_blocks: int) -> None:
    """Three adapters and the base, sharing a 12-token prefix, in batches chunked by an 8-token budget."""
    executor, ip = _setup(max_loras=2, num_kv_blocks=num_kv_blocks)
    executor.asynchronous = async_scheduling
    core = make_engine_core(executor, max_num_batched_tokens=8, async_scheduling=async_scheduling)
    for name in ("a", "b", "c"):
        core.add_lora(name, f"/adapters/{name}")
    ids = {adapter.name: adapter.lora_id for adapter in executor.loras.values()}
    rng = random.Random(3)
    prefix = [rng.randrange(1, 64) for _ in range(12)]
    plan = []
    for i in range(12):
        name = [None, "a", "b", "c"][i % 4]
        prompt = prefix + [rng.randrange(1, 64) for _ in range(i % 5)]
        request = ip.make_request(f"r{i}", prompt, SamplingParams(max_tokens=5), 0.0, lora=name)
        core.add_request(request)
        plan.append((request.request_id, prompt, 0 if name is None else ids[name]))
    out = _run(core)
    for request_id, prompt, lora_id in plan:
        assert out[request_id] == _expected(executor, prompt, 5, lora_id), (request_id, lora_id)
    assert core.stats().num_free_blocks == core.stats().num_total_blocks
    # The prefix was hit within an adapter (the base's, a's, ...), never across: the tokens above prove it.
    assert num_kv_blocks < 64 or core.stats().prefix_cache_hit_rate > 0


def test_a_request_waits_in_turn_for_an_adapter_slot() -> None:
    """max_loras=1: the head request's adapter waits for the running one's to end; nothing passes it."""
    executor, ip = _setup(max_loras=1)
    core = make_engine_core(executor, max_num_batched_tokens=64)
    core.add_lora("a", "/a")
    core.add_lora("b", "/b")
    first = ip.make_request("first", [5, 6, 7], SamplingParams(max_tokens=4), 0.0, lora="a")
    second = ip.make_request("second", [5, 6, 8], SamplingParams(max_tokens=4), 0.0, lora="b")
    base = ip.make_request("base", [5, 6, 9], SamplingParams(max_tokens=4), 0.0)
    for request in (first, second, base):
        core.add_request(request)
    first_step = [t for delta in core.step() for t in delta.new_token_ids]
    assert core.stats().num_running == 1 and core.stats().num_waiting == 2  # the base request keeps its place
    out = _run(core)
    assert len(first_step + out["first"]) == len(out["second"]) == len(out["base"]) == 4
    started = [new.request_id for step in executor.steps for new in step.new_requests]
    assert started == ["first", "second", "base"]


def test_an_urgent_request_preempts_for_an_adapter_slot() -> None:
    executor, ip = _setup(max_loras=1)
    core = make_engine_core(executor)
    core.add_lora("a", "/a")
    core.add_lora("b", "/b")
    core.add_request(ip.make_request("slow", [1, 2, 3], SamplingParams(max_tokens=30), 0.0, lora="a"))
    out: dict[str, list[RequestDelta]] = {"slow": core.step()}
    core.add_request(ip.make_request("urgent", [1, 2, 4], SamplingParams(max_tokens=3), 0.0, priority=-1, lora="b"))
    while "urgent" not in out or out["urgent"][-1].finish_reason is None:
        for delta in core.step():
            out.setdefault(delta.request_id, []).append(delta)
    assert out["slow"][-1].finish_reason is None  # it was preempted, and resumes
    assert core.stats().num_preemptions == 1
    assert len(_run(core)["slow"]) + sum(len(d.new_token_ids) for d in out["slow"]) == 30


def test_prefix_cache_is_keyed_by_the_adapters_identity() -> None:
    """Same tokens: a hit within one adapter, none across adapters or from the base, none for an adapter
    added again under a removed one's name (other weights), all with the reference's tokens."""
    executor, ip = _setup(max_loras=2)
    core = make_engine_core(executor)
    core.add_lora("a", "/a")
    prompt = list(range(1, 18))  # four full blocks of 4, and one token

    def run_one(request_id: str, lora: str | None) -> float:
        before = core.block_manager.num_hit_tokens
        core.add_request(ip.make_request(request_id, prompt, SamplingParams(max_tokens=2), 0.0, lora=lora))
        out = _run(core)
        lora_id = core.loras.get(lora).lora_id if lora else 0
        assert out[request_id] == _expected(executor, prompt, 2, lora_id)
        return core.block_manager.num_hit_tokens - before

    assert run_one("base", None) == 0
    assert run_one("a1", "a") == 0  # not the base's blocks
    assert run_one("a2", "a") == 16  # its own
    assert run_one("base2", None) == 16
    core.remove_lora("a")
    core.add_lora("a", "/a-retrained")
    assert run_one("a3", "a") == 0  # the same name, other weights


def test_adding_and_removing_refuse_clearly_and_change_nothing() -> None:
    executor, ip = _setup(max_loras=2)
    core = make_engine_core(executor, max_cpu_loras=2)
    executor.bad_lora_paths.add("/bad")
    with pytest.raises(LoRAError, match="cannot add LoRA adapter 'x': the adapter at /bad cannot serve"):
        core.add_lora("x", "/bad")
    assert core.lora_names() == [] and executor.loras == {}
    core.add_lora("a", "/a")
    with pytest.raises(LoRAError, match="named 'a' is already added"):
        core.add_lora("a", "/a2")
    core.add_lora("b", "/b")
    with pytest.raises(LoRAError, match=r"2 LoRA adapters are added, max_cpu_loras=2: remove one \(a, b\)"):
        core.add_lora("c", "/c")
    with pytest.raises(LoRAError, match="no LoRA adapter named 'zzz' is added \\(added: 'a', 'b'\\)"):
        core.remove_lora("zzz")
    with pytest.raises(InvalidRequestError, match="lora='zzz': no LoRA adapter named 'zzz'"):
        core.add_request(ip.make_request("r", [1, 2], SamplingParams(max_tokens=2), 0.0, lora="zzz"))
    core.add_request(ip.make_request("r1", [1, 2], SamplingParams(max_tokens=20), 0.0, lora="a"))
    core.add_request(ip.make_request("r2", [1, 2], SamplingParams(max_tokens=20, n=2), 0.0, lora="a"))
    core.step()
    with pytest.raises(LoRAError, match=r"'a' is in use by 3 live request\(s\): abort them or let them finish"):
        core.remove_lora("a")
    core.abort("r1")
    core.abort("r2")
    core.remove_lora("a")
    assert core.lora_names() == ["b"] and [a.name for a in executor.loras.values()] == ["b"]
    _run(core)


def test_an_engine_without_lora_refuses_adapters() -> None:
    executor, ip = _setup(max_loras=0)
    core = make_engine_core(executor)
    with pytest.raises(LoRAError, match="built without enable_lora=True"):
        core.add_lora("a", "/a")
    with pytest.raises(InvalidRequestError, match="lora='a': this engine was built without enable_lora=True"):
        ip.check_lora("a")
