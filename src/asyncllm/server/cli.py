"""`asyncllm serve [MODEL] [--host --port --api-key --served-model-name --drain-timeout] [every engine argument]`.

Owns the server's command line and running uvicorn (uvloop when installed). Parsing imports neither
FastAPI nor torch, so `asyncllm serve --help` is instant and works without the `server` extra installed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence

from asyncllm.default_model import DefaultModelMissingError, default_model_path
from asyncllm.server.engine_flags import add_engine_args, check_engine_args, engine_arg_specs, engine_args_from

API_KEY_ENV = "ASYNCLLM_API_KEY"


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
        "--served-model-name", default=None, help="the model name clients send (default: the checkpoint's name)"
    )
    server.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug", "trace"]
    )
    server.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, how long requests in flight may run on while new ones get 503; then they are "
        "aborted and the server exits (default: 30)",
    )
    add_engine_args(parser.add_argument_group("engine (every AsyncLLMEngine argument; see asyncllm.config)"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncllm serve", description="OpenAI-compatible HTTP server.")
    add_serve_arguments(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted; returns the process exit status."""
    try:
        model = args.model or str(default_model_path())
    except DefaultModelMissingError as exc:
        print(f"asyncllm: {exc}", file=sys.stderr)
        return 1
    if not os.path.exists(model):
        print(f"asyncllm: no checkpoint directory or .gguf file at {model}", file=sys.stderr)
        return 1
    try:
        import uvicorn

        from asyncllm.server.app import create_app
        from asyncllm.server.drain import DrainingServer
    except ImportError as exc:
        print(f"asyncllm: the server needs its extra: pip install 'asyncllm[server]' ({exc})", file=sys.stderr)
        return 1
    if not args.drain_timeout >= 0:  # NaN too
        print(f"asyncllm: --drain-timeout {args.drain_timeout} is invalid: give seconds >= 0", file=sys.stderr)
        return 1
    engine_args = engine_args_from(args, engine_arg_specs())
    try:
        check_engine_args(model, engine_args)
    except (TypeError, ValueError) as exc:
        print(f"asyncllm: {exc}", file=sys.stderr)
        return 1
    app = create_app(model, served_model_name=args.served_model_name, api_key=args.api_key, engine_args=engine_args)
    # loop="auto" takes uvloop when installed; the engine is built in the app's lifespan, before binding.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, loop="auto")
    server = DrainingServer(config, app.state.asyncllm, drain_timeout=args.drain_timeout)
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn shut down gracefully, then re-raised Ctrl-C
        server.run()
    return 0 if server.started else 1  # a failed startup (e.g. the model failed to load) never started


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
