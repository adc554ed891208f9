"""`asyncllm serve [MODEL] [--host --port --api-key --served-model-name --lora-modules --drain-timeout]
[--[no-]core-process] [--replicas N [--ray-address ADDR]] [connection bounds] [every engine argument]`.

Owns the server's command line and its start-up, cheapest check first: the arguments, then the address
(bound now, handed to uvicorn later: a busy port fails in a second, not after the model loaded), then the
engine (one whose core runs in a process of its own unless `--no-core-process`, or with `--replicas` a
`ReplicaPool` of engines on Ray: the same app serves either), then uvicorn (uvloop when installed) on the
bound socket. Every `AsyncLLMError` ends it with one line and an exit code (`asyncllm.console`). Parsing
imports neither FastAPI nor torch nor Ray, so `asyncllm serve --help` is instant and works without the
`server` extra installed.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import socket
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from asyncllm.console import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    LOG_LEVELS,
    chat_template_arg,
    configure_logging,
    report,
    report_error,
)
from asyncllm.default_model import DEFAULT_SERVED_NAME, default_model_path
from asyncllm.errors import AsyncLLMError, InvalidConfigError
from asyncllm.install import extra_install_hint
from asyncllm.server.connections import add_connection_arguments, check_connection_arguments, uvicorn_options
from asyncllm.server.engine_flags import add_engine_args, check_engine_args, engine_arg_specs, engine_args_from

if TYPE_CHECKING:
    from asyncllm import AsyncLLMEngine

API_KEY_ENV = "ASYNCLLM_API_KEY"
logger = logging.getLogger("asyncllm.server")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", nargs="?", default=None, help="checkpoint directory or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, local only)")
    server.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    server.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require `Authorization: Bearer KEY` on every endpoint but /health (default: ${API_KEY_ENV})",
    )
    server.add_argument(
        "--served-model-name",
        default=None,
        help=f"the model name clients send (default: the checkpoint's name; {DEFAULT_SERVED_NAME!r} for the built-in)",
    )
    server.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        default=[],
        type=lora_module_arg,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) to serve beside the model, each as its own model name; implies "
        "--enable-lora (see docs/lora.md)",
    )
    server.add_argument(
        "--chat-template",
        default=None,
        type=chat_template_arg,
        help="a Jinja chat template (a file, or the text itself) replacing the model's own, e.g. one that lists tools",
    )
    server.add_argument(
        "--log-level", default="info", choices=LOG_LEVELS, help="start-up banner and one line per request at info"
    )
    server.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, how long requests in flight may run on while new ones get 503; then they are "
        "aborted and the server exits (default: 30)",
    )
    server.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help='a request not finished this long after it arrived ends (finish_reason "timeout", or 408 before any '
        "output); the default for requests that send no `timeout`, and the most one may ask (default: none)",
    )
    server.add_argument(
        "--core-process",
        action=argparse.BooleanOptionalAction,
        dest="core_process",
        default=argparse.SUPPRESS,  # absent: the server's choice (`core_placement`)
        help="run the engine core (scheduling, detokenizing, the model) in a process of its own, so its Python "
        "work shares no GIL with the HTTP work; --no-core-process: a step thread in the server's process "
        "(default: on, but with --replicas, whose engines each run in a Ray actor)",
    )
    scale = parser.add_argument_group("replicas on Ray (the `ray` extra; docs/ray.md)")
    scale.add_argument(
        "--replicas",
        type=int,
        default=None,
        metavar="N",
        help="serve from N engines, each a Ray actor with its own GPU (or tensor-parallel group), requests routed "
        "to the least busy or to the one holding the prompt's prefix (default: one engine in this process)",
    )
    scale.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="the Ray cluster the replicas run on: 'auto' (the one `ray start` began on this machine), "
        "'HOST:6379', 'ray://HOST:10001' (default: $RAY_ADDRESS, else a local cluster started by this server)",
    )
    add_connection_arguments(parser)
    engine = parser.add_argument_group("engine (every AsyncLLMEngine argument; see asyncllm.config)")
    add_engine_args(engine, exclude=frozenset({"core_process"}))  # the server's own flag above, its own default


def lora_module_arg(value: str) -> tuple[str, str]:
    """`--lora-modules NAME=PATH`: an adapter's served name and its directory."""
    name, sep, path = value.partition("=")
    if not sep or not name.strip() or not path:
        raise argparse.ArgumentTypeError(f"{value!r} is not NAME=PATH (an adapter's name and its directory)")
    return name, path


def lora_modules(args: argparse.Namespace, engine_args: dict[str, Any]) -> dict[str, str]:
    """`--lora-modules` as {name: path}, turning `enable_lora` on in `engine_args` (UsageError: a name given
    twice or the model's own, or `--no-enable-lora` beside them)."""
    modules = dict(args.lora_modules)
    if not modules:
        return modules
    if len(modules) < len(args.lora_modules):
        raise InvalidConfigError("--lora-modules names an adapter twice: give each adapter its own name")
    if served_model_name(args) in modules:
        raise InvalidConfigError(
            f"--lora-modules names an adapter {served_model_name(args)!r}, the model's own served name: rename one"
        )
    if engine_args.get("enable_lora") is False:
        raise InvalidConfigError("--lora-modules needs LoRA: drop --no-enable-lora")
    engine_args["enable_lora"] = True
    return modules


def core_placement(args: argparse.Namespace, engine_args: dict[str, Any]) -> str:
    """Where the engine core runs, set as `engine_args["core_process"]` (unless `--replicas`), and why, for
    the log. The server's default is a process of its own, so the core's Python work shares no GIL with
    HTTP: the measured winner for serving (bench/RESULTS.md, run 54). `--no-core-process` keeps the step
    thread. A `ReplicaPool`'s engines each run in a Ray actor, whose core
    is a step thread there: `--replicas` leaves `core_process` unset (InvalidConfigError beside an explicit
    `--core-process`)."""
    asked = engine_args.get("core_process")
    if args.replicas is not None:
        if asked:
            raise InvalidConfigError(
                "--core-process and --replicas: each replica's engine runs in a Ray actor of its own, its core in "
                "a step thread there; drop --core-process"
            )
        engine_args.pop("core_process", None)
        return "a step thread in each replica's Ray actor (--replicas)"
    if asked is False:
        return "a step thread in the server's process (--no-core-process)"
    engine_args["core_process"] = True
    return "a process of its own"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncllm serve", description="OpenAI-compatible HTTP server.")
    add_serve_arguments(parser)
    return parser


def served_model_name(args: argparse.Namespace) -> str:
    """`--served-model-name`, else the checkpoint's directory name or .gguf file's stem, else (the built-in
    model) `smollm2`, the name docs/server.md's examples send."""
    if args.served_model_name:
        return str(args.served_model_name)
    if args.model is None:
        return DEFAULT_SERVED_NAME
    from asyncllm.server.app import default_served_name

    return default_served_name(args.model)


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted; returns the process exit status (docs/cli.md)."""
    start = time.perf_counter()
    configure_logging(args.log_level)
    if not args.drain_timeout >= 0:  # NaN too
        return report(f"--drain-timeout {args.drain_timeout} is invalid: give seconds >= 0", EXIT_USAGE)
    if args.request_timeout is not None and not 0 < args.request_timeout < float("inf"):
        return report(f"--request-timeout {args.request_timeout} is invalid: give seconds > 0", EXIT_USAGE)
    refused = check_connection_arguments(args)
    if refused is not None:
        return report(refused, EXIT_USAGE)
    if args.replicas is not None and args.replicas < 1:
        return report(f"--replicas {args.replicas} is invalid: give a number of engines >= 1", EXIT_USAGE)
    if args.ray_address is not None and args.replicas is None:
        return report("--ray-address places replicas on a Ray cluster: give --replicas N too", EXIT_USAGE)
    try:
        model = args.model or str(default_model_path())
        engine_args = engine_args_from(args, engine_arg_specs())
        adapters = lora_modules(args, engine_args)
        core = core_placement(args, engine_args)
        check_engine_args(model, engine_args)
    except AsyncLLMError as exc:
        return report_error(exc)
    if not os.path.exists(model):
        return report(f"no checkpoint directory or .gguf file at {model}")
    try:
        import uvicorn  # noqa: F401 (the extra's presence, checked before anything loads)

        from asyncllm.server.listen import bind
    except ImportError as exc:
        return report(f"the server needs its extra ({extra_install_hint('server')}): {exc}")
    if args.replicas is not None and importlib.util.find_spec("ray") is None:
        return report(f"--replicas needs Ray ({extra_install_hint('ray')})")
    try:
        sock = bind(args.host, args.port)
    except OSError as exc:
        return report(
            f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}; choose another --port", EXIT_USAGE
        )
    with sock:
        try:
            logger.info("engine core: %s", core)
            engine = _make_engine(model, engine_args, args)
        except AsyncLLMError as exc:
            return report_error(exc)
        except ConnectionError as exc:  # the Ray cluster could not be joined
            return report(exc)
        except KeyboardInterrupt:
            return report("interrupted while loading the model", EXIT_INTERRUPTED)
        try:
            if adapters:
                asyncio.run(_add_adapters(engine, adapters))  # the engine serves any loop: this one is brief
            return _serve(engine, model, args, sock, start)
        except AsyncLLMError as exc:  # an adapter that cannot be served
            return report_error(exc)
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED
        finally:
            engine.shutdown()


async def _add_adapters(engine: AsyncLLMEngine, adapters: dict[str, str]) -> None:
    for name, path in adapters.items():
        await engine.add_lora(name, path)
        logger.info('LoRA adapter %s from %s: clients send "model": "%s"', name, path, name)


def _make_engine(model: str, engine_args: dict[str, Any], args: argparse.Namespace) -> AsyncLLMEngine:
    """One engine in this process, or `--replicas` engines on Ray behind the same API."""
    if args.replicas is None:
        from asyncllm import AsyncLLMEngine

        return AsyncLLMEngine(model, **engine_args)
    from asyncllm.ray import ReplicaPool

    return ReplicaPool(model, num_replicas=args.replicas, ray_address=args.ray_address, **engine_args)


def _serve(engine: AsyncLLMEngine, model: str, args: argparse.Namespace, sock: socket.socket, start: float) -> int:
    import uvicorn

    from asyncllm.server.app import create_app
    from asyncllm.server.drain import DrainingServer

    name = served_model_name(args)
    app = create_app(
        engine,
        served_model_name=name,
        api_key=args.api_key,
        chat_template=args.chat_template,
        request_timeout=args.request_timeout,
        body_read_timeout=args.timeout_request_read,  # uvicorn's protocol bounds the headers too (connections.py)
    )
    engine_seconds = sum(seconds for _, seconds in engine.runtime.startup_seconds)

    def started() -> None:
        url = f"http://{args.host}:{sock.getsockname()[1]}/v1"  # the port bound, should --port be 0
        keyed = " (with the API key)" if args.api_key else ""
        logger.info('serving %s at %s: clients send "model": "%s"%s', model, url, name, keyed)
        total = time.perf_counter() - start
        rest = total - engine_seconds
        logger.info("ready in %.1f s (engine %.1f s, imports and server %.1f s)", total, engine_seconds, rest)

    config = uvicorn.Config(app, log_level=args.log_level, loop="auto", **uvicorn_options(args))
    server = DrainingServer(config, started, app.state.asyncllm, drain_timeout=args.drain_timeout)
    server.run(sockets=[sock])  # SIGTERM and Ctrl-C end it (asyncllm.server.drain), re-raising nothing
    return EXIT_OK if server.started else EXIT_FAILED


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
