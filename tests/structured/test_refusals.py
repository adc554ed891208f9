"""A constraint that cannot work is refused with `InvalidRequestError` naming its field, when the request is
made (`generate`, the stream's first read, `LLM.generate`), and leaves nothing behind: the engine carries on.
One that compiles but that no valid UTF-8 text satisfies ends its own request with that error, mid-batch."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from asyncllm import LLM, AsyncLLMEngine, InvalidRequestError, SamplingParams
from tests.async_engine.conftest import wait_drained
from tests.fixtures.fake_core import fake_built
from tests.structured.conftest import ENGINE_ARGS, check, constrained

BAD: list[tuple[dict[str, Any], str]] = [
    ({"json_schema": {"type": "foo"}}, r"SamplingParams\.json_schema .*Unsupported type"),
    ({"json_schema": {"type": "integer", "minimum": 5, "maximum": 1}}, r"SamplingParams\.json_schema .*minimum"),
    ({"regex": "a(b"}, r"SamplingParams\.regex .*parenthesis"),
    ({"grammar": 'root ::= "a" missing'}, r"SamplingParams\.grammar .*missing"),
    ({"grammar": 'start ::= "a"'}, r"SamplingParams\.grammar .*root"),
]


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[AsyncLLMEngine]:
    engine = AsyncLLMEngine(str(tiny_model), **ENGINE_ARGS)  # loads in its step thread; loop-independent
    yield engine
    engine.shutdown()


@pytest.mark.parametrize(("field", "message"), BAD, ids=["type", "range", "regex", "rule", "root"])
@pytest.mark.parametrize("prompt", ["Hello", [5, 6, 7]], ids=["text", "ids"])
async def test_bad_constraint_raises_when_made(
    engine: AsyncLLMEngine, field: dict[str, Any], message: str, prompt: Any
) -> None:
    params = SamplingParams(**field, max_tokens=8)
    with pytest.raises(InvalidRequestError, match=message):
        await engine.generate(prompt, params)
    stream = engine.stream(prompt, params)
    with pytest.raises(InvalidRequestError, match=message):
        await stream.__anext__()
    await wait_drained(engine)
    assert engine.num_live_requests == 0


async def test_engine_carries_on_after_refusals(engine: AsyncLLMEngine) -> None:
    good = await engine.generate([5, 6, 7], constrained("regex", "t1", seed=1))
    check("regex", good.text)


async def test_constraint_nothing_can_satisfy_ends_its_request_alone(engine: AsyncLLMEngine) -> None:
    """It compiles (xgrammar reads characters), but a UTF-16 surrogate has no valid UTF-8 form: the request
    fails with an error naming its field, not with a made-up token; its neighbours finish normally."""
    impossible = engine.generate([5, 6, 7], SamplingParams(grammar=r"root ::= [\ud800-\udfff]", max_tokens=8))
    neighbour = engine.generate([5, 6, 7], constrained("choice", "t1", seed=2))
    with pytest.raises(InvalidRequestError, match=r"SamplingParams\.grammar: no token"):
        await impossible
    check("choice", (await neighbour).text)
    await wait_drained(engine)


@pytest.mark.parametrize(
    ("extra", "message"),
    [({"ignore_eos": True}, "ignore_eos"), ({"min_tokens": 3}, "min_tokens=3")],
)
async def test_parameters_that_contradict_a_constraint_raise_at_once(
    engine: AsyncLLMEngine, extra: dict[str, Any], message: str
) -> None:
    params = SamplingParams(regex="[a-z]+", max_tokens=8, **extra)
    with pytest.raises(InvalidRequestError, match=rf"SamplingParams\.regex cannot be combined with {message}"):
        engine.add_request([5, 6], params)
    assert engine.num_live_requests == 0


async def test_engine_without_tokenizer_refuses_constraints() -> None:
    engine = AsyncLLMEngine.from_builder(lambda: fake_built(None))
    try:
        with pytest.raises(InvalidRequestError, match=r"SamplingParams\.choice needs the model's tokenizer"):
            engine.add_request([5, 6], SamplingParams(choice=["a", "b"]))
        assert engine.num_live_requests == 0
    finally:
        await engine.aclose()


def test_llm_refuses_the_batch_and_carries_on(llm: LLM) -> None:
    field, message = BAD[0]
    with pytest.raises(InvalidRequestError, match=message):
        llm.generate([[5, 6, 7], "Hello"], [SamplingParams(max_tokens=4), SamplingParams(**field)], use_tqdm=False)
    stats = llm.stats()
    assert stats["num_waiting"] == stats["num_running"] == 0, "a refused batch queues nothing"
    out = llm.generate("Hello", constrained("grammar", "greedy", seed=0), use_tqdm=False)[0]
    check("grammar", out.text)
