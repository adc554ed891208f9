"""Call a tool: the reply must be a call of `get_weather` (tool_choice="required") whose arguments satisfy
its schema; the call's result goes back, and the model answers in words.

python examples/tool_call.py [MODEL]   # MODEL: a checkpoint directory or .gguf; default: SmolLM2
"""

from __future__ import annotations

import argparse
import asyncio
import json

from asyncllm import AsyncLLMEngine, SamplingParams
from asyncllm.default_model import default_model_path

# SmolLM2's own template lists no tools: a Hermes-style one (Qwen2.5's shape) that does.
TEMPLATE = """{% if tools %}<|im_start|>system
You can call these functions:<tools>{% for t in tools %}
{{ t | tojson }}{% endfor %}
</tools>
Call one as <tool_call>
{"name": <name>, "arguments": <arguments>}
</tool_call><|im_end|>
{% endif %}{% for m in messages %}<|im_start|>{{ 'user' if m.role == 'tool' else m.role }}
{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
PARAMETERS = {"type": "object", "required": ["city", "unit"], "properties": {
    "city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}}}  # fmt: skip
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": PARAMETERS}}


async def main(model: str) -> None:
    async with AsyncLLMEngine(model, device="auto") as engine:
        messages: list[dict] = [{"role": "user", "content": "What is the weather like in Paris?"}]
        params = SamplingParams(temperature=0.0, max_tokens=128)
        tools, calls, text = {"tools": [WEATHER], "chat_template": TEMPLATE}, [], ""
        async for chunk in engine.chat(messages, params, tool_choice="required", **tools):
            text += chunk.text
            calls += [{"id": d.id, "type": "function", "function": {"name": d.name, "arguments": d.arguments}}
                      for d in chunk.tool_calls]  # fmt: skip  # (a call arrives whole, in one delta)
        for call in calls:
            print(f"tool call: {call['function']['name']}({call['function']['arguments']})")
        if not calls:  # the reply ran out of max_tokens (or the engine does not enforce grammars)
            return print(f"no call; the model said {text!r}")
        messages.append({"role": "assistant", "content": None, "tool_calls": calls})
        for call in calls:  # "run" the tool
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"celsius": 21})})
        async for chunk in engine.chat(messages, params, tool_choice="none", **tools):
            print(chunk.text, end="", flush=True)
        print()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", help="checkpoint directory or .gguf (default: SmolLM2-135M)")
    asyncio.run(main(parser.parse_args().model or str(default_model_path())))
