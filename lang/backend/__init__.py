"""Backends: ``RuntimeEndpoint`` (a radixserve server over HTTP) and ``EngineBackend`` (an in-process ``Engine``).

``EngineBackend`` is imported on first use, so a client that only talks HTTP never imports torch or the server.
"""

from typing import Any

from radixserve.lang.backend.base import Backend, GenOutput
from radixserve.lang.backend.runtime_endpoint import RuntimeEndpoint

__all__ = ["Backend", "EngineBackend", "GenOutput", "RuntimeEndpoint"]


def __getattr__(name: str) -> Any:
    if name == "EngineBackend":
        from radixserve.lang.backend.engine_backend import EngineBackend

        return EngineBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
