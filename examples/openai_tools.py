"""Structured output and a tool call through the server, with the official `openai` client unchanged:
`parse(response_format=PydanticModel)` fills `message.parsed`; a forced call of `get_weather`, its result
sent back, and the model's answer in words.

python examples/openai_tools.py [MODEL]   # default: the built-in SmolLM2

Needs the server extra and openai: pip install -e ".[server]" openai (from a clone; docs/install.md).
"""

from __future__ import annotations

import json
import sys

from json_extraction import TEXT, Person  # the same pydantic model as the Python example
from openai import OpenAI
from openai_client import start_server  # a server in a background thread, as `asyncllm serve` runs it
from tool_call import TEMPLATE, WEATHER  # SmolLM2's template lists no tools: a Hermes-style one that does


def main(base_url: str) -> None:
    with OpenAI(base_url=base_url, api_key="unused") as client:
        ask = [{"role": "user", "content": f"Extract the person as JSON (name, birth_year, city): {TEXT}"}]
        r = client.chat.completions.parse(model="local", messages=ask, response_format=Person, temperature=0)
        print(f"parsed: {r.choices[0].message.parsed!r}")

        messages: list = [{"role": "user", "content": "What is the weather like in Paris?"}]
        r = client.chat.completions.create(
            model="local", messages=messages, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=128
        )
        reply = r.choices[0].message
        for call in reply.tool_calls or []:  # finish_reason "tool_calls"; arguments are JSON text
            print(f"tool call: {call.function.name}({call.function.arguments})")
        if not reply.tool_calls:
            return print(f"no call ({r.choices[0].finish_reason}); the model said {reply.content!r}")
        messages.append(reply)  # the reply object as it came, as OpenAI's guide does
        for call in reply.tool_calls:  # "run" the tool
            messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"celsius": 21})})
        # tool_choice="none": the tools stay in the prompt, the reply is words
        r = client.chat.completions.create(
            model="local", messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=48
        )
        print(f"answer: {r.choices[0].message.content}")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        model = sys.argv[1]
    else:
        from asyncllm.default_model import default_model_path  # raises with the install command if absent

        model = str(default_model_path())
    server, thread, base_url = start_server(model, chat_template=TEMPLATE)
    try:
        main(base_url)
    finally:
        server.should_exit = True  # uvicorn stops; the lifespan closes the engine
        thread.join()
