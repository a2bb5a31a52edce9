"""A Python DSL for LLM programs over radixserve: text, ``gen``, ``select``, roles, ``fork``, batches, streaming.

    from radixserve.lang import RuntimeEndpoint, assistant, function, gen, set_default_backend, user

    @function
    def qa(s, question):
        s += user(question)
        s += assistant(gen("answer", max_tokens=64))

    set_default_backend(RuntimeEndpoint("http://127.0.0.1:30000"))
    print(qa.run(question="What is the capital of France?")["answer"])

See docs/dsl.md for the guide.
"""

from typing import Any

from radixserve.lang.backend import Backend, GenOutput, RuntimeEndpoint
from radixserve.lang.errors import BackendError, ChatTemplateError
from radixserve.lang.ir import assistant, gen, select, system, user
from radixserve.lang.program import Program, function, get_default_backend, set_default_backend
from radixserve.lang.state import ForkGroup, ProgramState

__all__ = [
    "Backend",
    "BackendError",
    "ChatTemplateError",
    "EngineBackend",
    "ForkGroup",
    "GenOutput",
    "Program",
    "ProgramState",
    "RuntimeEndpoint",
    "assistant",
    "function",
    "gen",
    "get_default_backend",
    "select",
    "set_default_backend",
    "system",
    "user",
]


def __getattr__(name: str) -> Any:
    if name == "EngineBackend":  # imported on first use: it needs torch and the server package
        from radixserve.lang.backend.engine_backend import EngineBackend

        return EngineBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
