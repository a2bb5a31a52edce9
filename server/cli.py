"""``radixserve serve [engine flags] [server flags]``: the HTTP server in front of one in-process engine.

Also ``radixserve router --worker-urls URL [URL ...]``: a data-parallel router in front of several servers, and
``radixserve ray-serve --replicas N [engine flags]``: replicas and router as Ray Serve deployments (needs the
``ray`` extra). See docs/scaling.md.

Start-up order: the resolved config is logged, uvicorn starts listening (/health answers 503), the engine
loads on a background thread (the loader logs progress and the KV cache size), then one line says
``radixserve ready: serving <model> at http://<host>:<port> (OpenAI API at /v1)``. If loading fails, the
server stops and the process exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import socket
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import NoReturn

from radixserve.runtime import envs
from radixserve.runtime.config import EngineConfig, add_arguments, check_env_errors, from_args
from radixserve.runtime.logs import configure_logging
from radixserve.runtime.lora_spec import lora_names
from radixserve.server.config import ServerConfig, check_adapter_names, default_served_name

logger = logging.getLogger("radixserve.server")

LOAD_CHECK_S = 0.2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve", description="radixserve: an LLM serving engine.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="Serve a model over HTTP (OpenAI-compatible /v1 and SGLang-style native routes).",
        description="Every flag can also be set with an environment variable RADIXSERVE_<FLAG_NAME>.",
    )
    serve.add_argument(
        "model_tag", nargs="?", metavar="MODEL", help="The model, as `vllm serve MODEL` takes it (same as --model)."
    )
    add_arguments(serve.add_argument_group("engine"), EngineConfig)  # type: ignore[arg-type]
    add_arguments(serve.add_argument_group("server"), ServerConfig)  # type: ignore[arg-type]
    _add_router_commands(commands)
    return parser


def _add_router_commands(commands: argparse._SubParsersAction) -> None:
    from radixserve.server.router.config import RayServeConfig, RouterConfig, RoutingConfig, add_config_arguments

    router = commands.add_parser(
        "router",
        help="Route requests over several radixserve servers (data parallelism, cache-aware).",
        description="Every flag can also be set with an environment variable RADIXSERVE_<FLAG_NAME>.",
    )
    add_config_arguments(router.add_argument_group("router"), RouterConfig)
    add_config_arguments(router.add_argument_group("routing"), RoutingConfig)
    ray_serve = commands.add_parser(
        "ray-serve",
        help="Run N engine replicas and the cache-aware router as Ray Serve deployments (pip install radixserve[ray]).",
        description="Every flag can also be set with an environment variable RADIXSERVE_<FLAG_NAME>.",
    )
    add_arguments(ray_serve.add_argument_group("engine"), EngineConfig)  # type: ignore[arg-type]
    add_config_arguments(ray_serve.add_argument_group("ray serve"), RayServeConfig)
    add_config_arguments(ray_serve.add_argument_group("routing"), RoutingConfig)


def serve(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    logger.info("engine config: %s", json.dumps(asdict(engine_config)))
    logger.info("server config: %s", json.dumps(server_config.redacted()))
    if server_config.allow_runtime_lora_updating and not server_config.api_key:
        logger.warning(
            "--allow-runtime-lora-updating without --api-key: any client can load adapters from this machine's folders"
        )
    try:  # before the engine starts: a port in use must not cost a model load (and leave an engine behind)
        sock = _bind(server_config.host, server_config.port)
    except OSError as exc:
        logger.error("cannot listen on %s:%d (--host, --port): %s", server_config.host, server_config.port, exc)
        return 1
    if server_config.engine_process:
        from radixserve.runtime.engine_spawn import spawn_engine_process

        # Started first, before this process imports its server stack: the engine's `import torch` and model load
        # run while this process imports the server and starts listening.
        spawned = spawn_engine_process(engine_config)
        from radixserve.runtime.engine_process import EngineProcess

        factory = EngineProcess(spawned=spawned, wait=False).wait_ready
    else:
        from radixserve.runtime.engine import Engine

        factory = lambda: Engine(engine_config)  # noqa: E731
    import uvicorn

    from radixserve.server.app import attach_server, create_app
    from radixserve.server.lifecycle import uvicorn_options

    app = create_app(factory, server_config, model=engine_config.model)
    uv_config = uvicorn.Config(
        app,
        host=server_config.host,
        port=server_config.port,
        log_config=None,  # keep our handlers and format for uvicorn's loggers too
        log_level=server_config.log_level,
        **uvicorn_options(server_config),
    )
    server = uvicorn.Server(uv_config)
    attach_server(app, server)
    # uvicorn handles SIGTERM with a graceful shutdown, then re-raises it to the handler it found: with the
    # default one the process would die by the signal (status 143) after a clean shutdown. This one makes it exit
    # 0, and also stops a server that got SIGTERM before uvicorn took the signal over.
    signal.signal(signal.SIGTERM, lambda *_: setattr(server, "should_exit", True))

    import asyncio  # here, not at the top: after the engine process is started

    async def run() -> int:
        watcher = asyncio.ensure_future(_stop_on_load_failure(server, app.state.server))
        try:
            await server.serve(sockets=[sock])
        finally:
            watcher.cancel()
        return 1 if app.state.server.load_error or not server.started else 0

    try:
        return asyncio.run(run())
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl+C it handled, after a clean shutdown
        return 0


def _bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound (uvicorn listens on it once the app is imported)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


async def _stop_on_load_failure(server, state) -> None:  # noqa: ANN001 - uvicorn.Server, ServerState
    import asyncio

    while not state.load_error:
        await asyncio.sleep(LOAD_CHECK_S)
    server.should_exit = True


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    command = _subcommand(parser, args.command)  # errors print its usage: "radixserve serve: error: ..."
    check_env_errors(command, args)
    errors = _EnvHints(command, argv)
    if args.command == "router":
        return _router(errors, args)
    if args.command == "ray-serve":
        return _ray_serve(errors, args)
    if args.model_tag:
        if errors.given("--model", "--model-path") and args.model != args.model_tag:
            errors.error(f"the model is given twice ({args.model_tag!r} and --model {args.model!r}): give it once")
        args.model = args.model_tag
    try:
        engine_config = from_args(EngineConfig, args)
        server_config = from_args(ServerConfig, args)
        served = server_config.served_model_name or (default_served_name(engine_config.model),)
        check_adapter_names(lora_names(engine_config.lora_modules), served, engine_config.model)
    except ValueError as exc:
        errors.error(str(exc))
    configure_logging(server_config.log_level, server_config.log_format)
    if engine_config.node_rank > 0:
        from radixserve.runtime.distributed import run_worker_node

        return run_worker_node(engine_config)  # tensor-parallel ranks only; node 0 serves
    return serve(engine_config, server_config)


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return actions[0].choices[name]


class _EnvHints:
    """The parser, whose ``error`` names the ``RADIXSERVE_*`` variables behind the flags a message names (a value
    from the environment is otherwise hard to tell from a default), e.g. "--dtype must be ... (set by
    RADIXSERVE_DTYPE='fp8')"."""

    def __init__(self, parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> None:
        self.parser = parser
        self._args = {a.split("=")[0] for a in (sys.argv[1:] if argv is None else argv)}

    def given(self, *flags: str) -> bool:
        """Whether any of ``flags`` is on the command line (as ``--flag value`` or ``--flag=value``)."""
        return not self._args.isdisjoint(flags)

    def error(self, message: str) -> NoReturn:
        hints = []
        for flag in dict.fromkeys(re.findall(r"--([a-z][a-z0-9-]*)", message)):
            name = envs.PREFIX + flag.upper().replace("-", "_")
            if os.environ.get(name) and not self.given(f"--{flag}"):
                hints.append(f"{name}={os.environ[name]!r}")
        self.parser.error(message + (f" (set by {', '.join(hints)})" if hints else ""))


def _router(parser: _EnvHints, args: argparse.Namespace) -> int:
    from radixserve.server.router.config import RouterConfig, RoutingConfig
    from radixserve.server.router.process import run_router

    try:
        config, routing = from_args(RouterConfig, args), from_args(RoutingConfig, args)
    except ValueError as exc:
        parser.error(str(exc))
    configure_logging(config.log_level)
    return run_router(config, routing)


def _ray_serve(parser: _EnvHints, args: argparse.Namespace) -> int:
    from radixserve.server.router.config import RayServeConfig, RoutingConfig

    try:
        engine_config, routing = from_args(EngineConfig, args), from_args(RoutingConfig, args)
        ray_config = from_args(RayServeConfig, args)
    except ValueError as exc:
        parser.error(str(exc))
    configure_logging(ray_config.log_level)
    try:
        from radixserve.server.router.ray_serve import run_ray_serve
    except ImportError as exc:
        parser.error(f"ray-serve needs Ray Serve: pip install 'radixserve[ray]' ({exc})")
    return run_ray_serve(engine_config, routing, ray_config)


if __name__ == "__main__":
    sys.exit(main())
