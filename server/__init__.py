"""The HTTP server: OpenAI-compatible /v1 routes and SGLang-style native routes over the in-process engine.

``create_app(engine_or_factory, server_config)`` builds the FastAPI app; ``radixserve serve`` runs it.
"""

from server.app import attach_server, create_app
from server.config import ServerConfig

__all__ = ["ServerConfig", "attach_server", "create_app"]
