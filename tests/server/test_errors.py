"""Errors in OpenAI's shape: 400 naming the field (pydantic, SamplingParams and engine-side checks alike),
401 without the key, 404 for an unknown model or path, and a generic 500 without a traceback; each surfaces
as the openai client's own exception class."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from asyncllm import AsyncLLMEngine
from asyncllm.server import create_app
from tests.server.conftest import API_KEY, MODEL
from tests.server.serving import RunningServer, start_server

MESSAGES: list[Any] = [{"role": "user", "content": "Hi"}]


def _bad_chat(client: openai.OpenAI, **kwargs: Any) -> dict[str, Any]:
    extra = kwargs.pop("extra_body", None)
    args: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**args, extra_body=extra)
    assert info.value.status_code == 400
    body = info.value.body
    assert isinstance(body, dict) and body["type"] == "invalid_request_error"
    return body


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        (dict(temperature=-1), "temperature"),  # SamplingParams refuses it
        (dict(top_p=0), "top_p"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=None, max_completion_tokens=0), "max_completion_tokens"),
        (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
        (dict(top_logprobs=2), "top_logprobs"),  # needs logprobs=True
        (dict(stop=[""]), "stop"),
        (dict(n=0), "n"),  # pydantic bound
        (dict(temperature="hot"), "temperature"),  # pydantic type
        (dict(extra_body={"top_k": -5}), "top_k"),
        (dict(extra_body={"unknown_knob": 1}), "unknown_knob"),  # unknown fields are refused, as OpenAI does
        (dict(stream_options={"include_usage": True}), "stream_options"),  # only with stream=true
        (dict(messages=[{"role": "user"}]), "messages[0].content"),
        (
            dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
            "messages[0].content[0]",
        ),
        (dict(messages=[{"role": "user", "content": "word " * 600}]), "messages"),  # over max_model_len (engine)
    ],
)
def test_chat_400_names_the_field(client: openai.OpenAI, kwargs: dict[str, Any], param: str) -> None:
    body = _bad_chat(client, **kwargs)
    assert body["param"] == param, body
    assert "Traceback" not in body["message"]


@pytest.mark.parametrize(
    ("prompt", "extra", "param"),
    [
        ("", {}, "prompt"),  # empty prompt (engine)
        ([1, 2, 100000], {}, "prompt"),  # an id outside the vocabulary (engine)
        ([[1, 2], "mixed"], {}, "prompt"),
        ([], {}, "prompt"),
        ("Hi", {"logprobs": 50}, "logprobs"),
        ("Hi", {"echo": True, "logprobs": 50}, "logprobs"),  # the prompt's logprobs are checked as the completion's
    ],
)
def test_completion_400_names_the_field(client: openai.OpenAI, prompt: Any, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body=extra)
    assert isinstance(info.value.body, dict) and info.value.body["param"] == param, info.value.body


def test_invalid_json_and_missing_fields_are_400(server: RunningServer) -> None:
    r = httpx.post(
        f"{server.base_url}/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{server.base_url}/chat/completions", json={"model": MODEL})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert isinstance(info.value.body, dict)
    assert (info.value.body["code"], info.value.body["param"]) == ("model_not_found", "model")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_unknown_path_is_an_openai_404(server: RunningServer) -> None:
    r = httpx.get(f"{server.url}/v1/nothing-here")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_api_key(keyed_server: RunningServer) -> None:
    with openai.OpenAI(base_url=keyed_server.base_url, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as info:
            bad.models.list()
        assert isinstance(info.value.body, dict) and info.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    for path in ("/metrics", "/v1/models", "/docs", "/nope"):
        assert httpx.get(keyed_server.url + path).status_code == 401, path
    assert httpx.get(keyed_server.url + "/health").status_code == 200  # probes need no key
    with openai.OpenAI(base_url=keyed_server.base_url, api_key=API_KEY, max_retries=0) as good:
        # ignore_eos: an unseeded draw at temperature 1 may end the reply with EOS before the count is reached
        r = good.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"ignore_eos": True})
        assert r.usage is not None and r.usage.completion_tokens == 2
    headers = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(keyed_server.url + "/metrics", headers=headers).status_code == 200


def test_unexpected_error_is_a_generic_500(engine: AsyncLLMEngine, caplog: pytest.LogCaptureFixture) -> None:
    app = create_app(engine, served_model_name=MODEL)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("secret internal detail")

    running = start_server(app)
    try:
        r = httpx.get(running.url + "/boom")
    finally:
        running.stop()
    assert r.status_code == 500
    assert r.json() == {
        "error": {"message": "internal server error", "type": "server_error", "param": None, "code": None}
    }
    assert "secret" not in r.text and "Traceback" not in r.text
    assert any("secret internal detail" in str(rec.exc_info) for rec in caplog.records)  # logged, not sent
