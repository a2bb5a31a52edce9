"""The HTTP server: OpenAI-compatible /v1 routes and SGLang-style native routes over the in-process engine.

``create_app(engine_or_factory, server_config)`` builds the FastAPI app; ``radixserve serve`` runs it.
"""

import os

# Before torch is imported (libgomp reads it once, at load): idle OpenMP workers sleep instead of spinning. The
# model is loaded on one thread and run on the engine thread; with spinning workers the two threads' OpenMP teams
# fight over the cores, and on a small CPU machine every decode step of `radixserve serve` ran 10-50x slower.
# An explicit OMP_WAIT_POLICY in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from server.app import attach_server, create_app  # noqa: E402
from server.config import ServerConfig  # noqa: E402

__all__ = ["ServerConfig", "attach_server", "create_app"]
