"""Fuzzing every `SamplingParams` field and every argument of `add_request`/`stream`/`generate`/`abort`
(issue 10): no input kills the engine, and nothing but `InvalidRequestError` naming what is wrong (or a
`TypeError` from Python's own argument binding) comes back."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import re
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from asyncllm import AsyncLLMEngine, InvalidRequestError, SamplingParams
from asyncllm.validation import as_float32
from tests.fixtures.fake_core import fake_built

_FIELDS = [f.name for f in dataclasses.fields(SamplingParams) if f.init]
_REAL = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def _huge(i: int) -> int:
    return i * 10**400


_ATOMS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers().map(_huge),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=-1e-30, max_value=1e-30),
    st.sampled_from([1e39, -1e39, 3.4e38, 1e-300, 1e300, 10**400, 0.5, 1, 2, 0, -1, 100, 0.01]),
    st.text(max_size=8),
    st.binary(max_size=4),
)
_VALUES = st.one_of(_ATOMS, st.lists(_ATOMS, max_size=4), st.dictionaries(st.text(max_size=3), _ATOMS, max_size=2))


@settings(max_examples=600, deadline=None)
@given(st.dictionaries(st.sampled_from(_FIELDS), _VALUES, max_size=4))
@pytest.mark.slow
def test_sampling_params_accept_or_name_the_field(kwargs: dict[str, Any]) -> None:
    try:
        params = SamplingParams(**kwargs)
    except InvalidRequestError as exc:
        name = re.match(r"SamplingParams\.(\w+)=", str(exc))
        assert name is not None and name.group(1) in kwargs, str(exc)
        return
    for field in _REAL:  # accepted: every real reaches the device finite (float32), as a float
        value = getattr(params, field)
        assert isinstance(value, float) and math.isfinite(as_float32(value))


@pytest.fixture(scope="module")
def fuzz_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[AsyncLLMEngine, asyncio.AbstractEventLoop]]:
    from asyncllm.core.detokenizer import backend_tokenizer
    from tests.fixtures.tiny_models import build_tokenizer

    tokenizer = backend_tokenizer(build_tokenizer(tmp_path_factory.mktemp("tok")))
    built = fake_built(tokenizer, max_model_len=64, num_kv_blocks=256)
    engine = AsyncLLMEngine.from_builder(lambda: built)
    loop = asyncio.new_event_loop()
    yield engine, loop
    loop.close()
    engine.shutdown()


_TOKENS = st.lists(st.one_of(st.integers(-5, 400), st.integers(), st.booleans(), st.floats(), st.text(max_size=2)))
_VALID_PROMPTS = st.one_of(st.text(min_size=1, max_size=40), st.lists(st.integers(1, 383), min_size=1, max_size=60))
_PROMPTS = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=st.characters(codec=None, categories=["Cs", "Lu", "Ll", "So"]), max_size=10),
    st.lists(st.integers(1, 383), max_size=80),
    _TOKENS,
    st.tuples(st.integers(1, 383), st.integers(1, 383)),
    _ATOMS,
)
_PARAMS = st.one_of(
    st.none(),
    st.builds(
        SamplingParams,
        max_tokens=st.one_of(st.none(), st.integers(1, 4)),
        min_tokens=st.integers(0, 1),
        temperature=st.floats(0, 5),
        stop=st.one_of(st.none(), st.text(min_size=1, max_size=3)),
        stop_token_ids=st.one_of(st.none(), st.lists(st.integers(0, 10**30), max_size=3)),
        seed=st.one_of(st.none(), st.integers()),
        top_k=st.integers(-1, 10**20),
        logprobs=st.one_of(st.none(), st.integers(0, 20)),
    ),
    st.builds(SamplingParams, min_tokens=st.integers(30, 100)),  # prompt + min_tokens past max_model_len
    _VALUES,
)
_IDS = st.one_of(st.none(), st.text(max_size=6), _ATOMS, st.lists(st.text(max_size=2), max_size=2))
_VALID_PARAMS = st.builds(SamplingParams, max_tokens=st.integers(1, 4), temperature=st.floats(0, 2), seed=st.integers())
_VALID_IDS = st.one_of(st.none(), st.text(min_size=1, max_size=6))
_CASES = st.one_of(  # half of them valid throughout, so the served path is fuzzed as much as the refusals
    st.tuples(_VALID_PROMPTS, _VALID_PARAMS, _VALID_IDS),
    st.tuples(_PROMPTS, _PARAMS, _IDS),
)
_NAMES = ("prompt", "params", "SamplingParams", "request_id", "min_tokens", "stop", "token")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_CASES, how=st.sampled_from(["stream", "generate", "abort"]))
def test_no_argument_kills_the_engine(fuzz_engine: Any, case: tuple[Any, Any, Any], how: str) -> None:
    engine, loop = fuzz_engine
    prompt, params, request_id = case

    async def one() -> None:
        try:
            if how == "abort":
                await engine.abort(request_id)
            elif how == "generate":
                out = await engine.generate(prompt, params, request_id)
                assert out.finish_reason in ("stop", "length")
            else:
                chunks = [c async for c in engine.stream(prompt, params, request_id)]
                assert chunks[-1].finish_reason in ("stop", "length")
            event(f"{how}: served")
        except InvalidRequestError as exc:
            assert any(name in str(exc) for name in _NAMES), str(exc)
            event(f"{how}: refused")

    loop.run_until_complete(asyncio.wait_for(one(), 10))
    assert engine.is_running and engine.num_live_requests == 0
    loop.run_until_complete(engine.check_health())
