"""Extract structured data into a pydantic model: the reply is constrained to the model's JSON schema, so it
always parses and validates (a reply cut short by max_tokens is the one exception).

python examples/json_extraction.py [MODEL]   # MODEL: a checkpoint directory or .gguf; default: SmolLM2
"""

from __future__ import annotations

import argparse
import asyncio

from pydantic import BaseModel, Field

from asyncllm import AsyncLLMEngine, SamplingParams
from asyncllm.default_model import default_model_path

TEXT = "Ada Lovelace, born in London in 1815, wrote the first published computer program."


class Person(BaseModel):
    name: str = Field(max_length=40)
    birth_year: int = Field(ge=1000, le=2100)
    city: str = Field(max_length=40)


async def main(model: str) -> None:
    async with AsyncLLMEngine(model, device="auto") as engine:
        messages = [{"role": "user", "content": f"Extract the person as JSON (name, birth_year, city): {TEXT}"}]
        params = SamplingParams(temperature=0.0, max_tokens=256, json_schema=Person)  # the class, or its schema
        reply, finish = "", None
        async for chunk in engine.chat(messages, params):
            reply, finish = reply + chunk.text, chunk.finish_reason
        print(f"reply: {reply}")
        if finish != "stop":
            return print(f"cut short ({finish}): not a whole object")
        print(f"parsed: {Person.model_validate_json(reply)!r}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", help="checkpoint directory or .gguf (default: SmolLM2-135M)")
    asyncio.run(main(parser.parse_args().model or str(default_model_path())))
