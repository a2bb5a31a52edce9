"""The HTTP server: OpenAI-compatible /v1 routes and SGLang-style native routes over the in-process engine.

``create_app(engine_or_factory, server_config)`` builds the FastAPI app; ``radixserve serve`` runs it.
"""

# OMP_WAIT_POLICY is left as the environment sets it. libgomp's default (idle workers spin briefly, then sleep)
# is what a decode step's chain of short ops needs: forcing PASSIVE made `radixserve serve` ~20% slower on a quiet
# 2-core machine (`python -m bench.omp_wait_policy`, 8 clients: 154 vs 196 output tok/s). The spinning is safe
# because the engine thread holds the process's only OpenMP team (the model loads and the CPU kernels self-check
# on one intra-op thread); two teams spinning against each other were what once made steps 10-50x slower.

from typing import Any

__all__ = ["ServerConfig", "attach_server", "create_app"]


def __getattr__(name: str) -> Any:
    # Lazy: `radixserve serve` starts the engine process before it imports the app (and torch with it).
    if name == "ServerConfig":
        from radixserve.server.config import ServerConfig

        return ServerConfig
    if name in ("attach_server", "create_app"):
        from radixserve.server import app

        return getattr(app, name)
    raise AttributeError(f"module 'server' has no attribute {name!r}")
