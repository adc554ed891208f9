"""The server over an engine whose core runs in a process of its own (`--core-process`): the same tests as
over the in-process step thread (collected again here, against this module's engine), and what the second
process adds: a killed core makes every live stream end with an error event, /health and /health/live 503,
and new requests 503, at once."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from asyncllm import AsyncLLMEngine
from asyncllm.server import create_app
from tests.server.conftest import ENGINE_ARGS, MODEL
from tests.server.serving import RunningServer, core_processes, start_server
from tests.server.test_concurrency import test_64_concurrent_streams_equal_their_non_streamed_answers  # noqa: F401
from tests.server.test_disconnect import (  # noqa: F401
    test_client_gone_before_the_first_event_aborts,
    test_non_streaming_client_that_gives_up_aborts,
    test_raw_stream_closed_after_the_role_chunk_aborts,
    test_streaming_client_that_disconnects_aborts,
)
from tests.server.test_echo import (  # noqa: F401
    reference,
    test_echo_streamed_equals_whole,
    test_echo_with_a_completion_as_harnesses_ask,
)
from tests.server.test_metrics import test_metrics_parse_and_move  # noqa: F401
from tests.server.test_openai_client import (  # noqa: F401
    test_chat_logprobs,
    test_chat_matches_the_engine_and_counts_usage,
    test_chat_stream_concatenates_to_the_whole_answer,
    test_completion_logprobs,
    test_completions_streamed_and_not,
    test_stop_strings_end_the_answer_without_the_stop,
)
from tests.server.test_samples import (  # noqa: F401
    test_streamed_chat_samples_join_to_the_whole_ones_while_sharing_blocks,
    test_streamed_samples_join_to_the_whole_ones_while_sharing_blocks,
)
from tests.server.test_sse import test_chat_stream_shape, test_completion_stream_shape  # noqa: F401
from tests.server.test_structured import (  # noqa: F401
    test_bad_constraints_are_a_400_naming_the_field,
    test_extras_regex_and_choice_streamed_and_not,
)

pytestmark = pytest.mark.slow  # the module's engine core runs in a process of its own: seconds to start


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[AsyncLLMEngine]:
    engine = AsyncLLMEngine(str(tiny_model), core_process=True, **ENGINE_ARGS)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(engine: AsyncLLMEngine) -> Iterator[RunningServer]:
    running = start_server(create_app(engine, served_model_name=MODEL))
    yield running
    running.stop()


def test_a_killed_core_is_an_error_event_and_503_everywhere(engine: AsyncLLMEngine, server: RunningServer) -> None:
    """Defined last, so collected last: it kills the module's engine."""
    (core,) = core_processes(os.getpid())
    with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0) as client:
        stream = client.completions.create(
            model=MODEL, prompt=[1, 2, 3], max_tokens=480, stream=True, extra_body={"ignore_eos": True}
        )
        next(iter(stream))
        os.kill(core, signal.SIGKILL)
        with pytest.raises(openai.APIError, match="not serving"):  # the error event of the live stream
            for _ in stream:
                pass
        for path in ("/health", "/health/live"):
            r = httpx.get(f"{server.url}{path}")
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
            assert "core process" in r.json()["error"]["message"]
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2)
        assert info.value.status_code == 503
    t0 = time.monotonic()
    engine.shutdown()
    assert time.monotonic() - t0 < 2.0
