"""What the command line (`asyncllm chat`, `serve`, `fetch-model`) shares: its exit codes, one-line error
reports, and logging to stderr. docs/cli.md documents the codes; the commands themselves live in `cli.py`
and `server/cli.py`. Imports neither torch nor the engine.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TextIO

from asyncllm.errors import AsyncLLMError, InvalidConfigError, InvalidRequestError, UnknownArgumentError

EXIT_OK = 0
EXIT_FAILED = 1  # the model could not be loaded or served: missing, unsupported, no such device, the engine died
EXIT_USAGE = 2  # a bad command line: a flag or value refused (argparse's own code), or an address in use
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as shells report it

# uvicorn's extra level below DEBUG; asyncllm logs nothing below DEBUG.
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


def exit_code_for(error: AsyncLLMError) -> int:
    """A refused argument (engine argument, sampling value) is a usage error; anything else a failure."""
    if isinstance(error, (InvalidConfigError, UnknownArgumentError, InvalidRequestError)):
        return EXIT_USAGE
    return EXIT_FAILED


def report(message: object, code: int = EXIT_FAILED) -> int:
    """Print `asyncllm: message` to stderr (no traceback: the message names what is wrong) and return `code`."""
    print(f"asyncllm: {message}", file=sys.stderr)
    return code


def report_error(error: AsyncLLMError) -> int:
    return report(error, exit_code_for(error))


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever `sys.stderr` is when a record is emitted (a test may have swapped it since)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass  # always sys.stderr


def configure_logging(level: str = "info") -> None:
    """asyncllm's loggers (`asyncllm` and below) to stderr at `level`, one line per record. Idempotent: a
    second call replaces the first's handler."""
    logger = logging.getLogger("asyncllm")
    for handler in [h for h in logger.handlers if isinstance(h, _StderrHandler)]:
        logger.removeHandler(handler)
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(_FORMAT, "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if level == "trace" else level.upper())


def chat_template_arg(value: str) -> str:
    """`--chat-template`: a file's contents when `value` names one, else the template text itself (which a
    Jinja template shows by its `{{` or `{%`)."""
    from jinja2 import Environment, TemplateSyntaxError  # what transformers renders templates with

    path = Path(value).expanduser()
    if path.is_file():
        template = path.read_text()
    elif "{{" in value or "{%" in value:
        template = value
    else:
        raise argparse.ArgumentTypeError(f"{value!r} is neither a file nor a Jinja template (no {{{{ or {{% in it)")
    try:
        Environment().parse(template)  # a broken template fails now, not after the model has loaded
    except TemplateSyntaxError as exc:
        raise argparse.ArgumentTypeError(f"the template does not parse: {exc} (line {exc.lineno})") from None
    return template
