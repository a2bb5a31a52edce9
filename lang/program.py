"""``@function`` programs: ``prog.run(...)``, ``prog.run(..., stream=True)``, ``prog.run_batch([...])``.

Keyword arguments of ``run`` that name a parameter of the program go to the program; the others must be sampling
parameters (``max_tokens``, ``temperature``, ``stop``, ...) and become the run's defaults, which a ``gen`` overrides
parameter by parameter. Whatever is set nowhere takes the server's default.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from radixserve.lang.backend.base import Backend
from radixserve.lang.ir import SAMPLING_KEYS, sampling_dict
from radixserve.lang.state import ProgramState, _Executor

MAX_AUTO_THREADS = 64

_default_backend: Backend | None = None


def set_default_backend(backend: Backend | None) -> None:
    """The backend ``run``/``run_batch`` use when given none (``None`` clears it)."""
    global _default_backend
    _default_backend = backend


def get_default_backend() -> Backend | None:
    return _default_backend


class Program:
    """A program made by ``@function``. Calling it with a state (``other(s, x=1)``) runs it inside another
    program, on that state."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        params = list(inspect.signature(fn).parameters.values())
        if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
            raise TypeError(f"{fn.__name__}: a program takes the state as its first positional parameter")
        named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        self.fn = fn
        self._arg_names = {p.name for p in params[1:] if p.kind in named}
        self._any_kwargs = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)
        functools.update_wrapper(self, fn)

    def __repr__(self) -> str:
        return f"<program {self.fn.__name__}>"

    def __call__(self, s: ProgramState, *args: Any, **kwargs: Any) -> Any:
        return self.fn(s, *args, **kwargs)

    # --- running --------------------------------------------------------------------------------------------
    def run(self, *args: Any, backend: Backend | None = None, stream: bool = False, **kwargs: Any) -> ProgramState:
        """Run the program and return its final state; raise the error that escaped the program function, else the
        first error no read inside the program raised.

        With ``stream=True`` it returns at once while the program runs in the background: read the text as it is
        generated with ``state.text_iter(name)``; any other read waits for the end (and raises errors then).
        """
        program_kwargs, defaults = self._split(kwargs)
        executor = _Executor(self._backend(backend), defaults, stream)
        if stream:
            state = ProgramState(executor)
            driver = threading.Thread(
                target=self._drive, args=(state, args, program_kwargs), name="radixserve-lang-program", daemon=True
            )
            state._driver = driver
            driver.start()
            return state
        state = ProgramState(executor)
        self._drive(state, args, program_kwargs)
        err = executor.escaped or executor.unseen_error()
        if err is not None:
            raise err
        return state

    def run_batch(
        self,
        batch_kwargs: Sequence[dict[str, Any]],
        *,
        backend: Backend | None = None,
        num_threads: int | str = "auto",
        raise_errors: bool = True,
        **defaults: Any,
    ) -> list[ProgramState]:
        """Run the program once per kwargs dict, ``num_threads`` at a time (``"auto"``: all, up to 64), and return
        the states in input order. The requests of concurrent runs reach the server together and share its batch.

        ``raise_errors=False`` returns failed runs too: their ``state.error`` is set and their reads raise it.
        """
        items = list(batch_kwargs)
        if not items:
            return []
        chosen = self._backend(backend)
        workers = min(len(items), MAX_AUTO_THREADS) if num_threads == "auto" else int(num_threads)
        if workers < 1:
            raise ValueError(f"num_threads must be >= 1 or 'auto', got {num_threads!r}")

        def one(kwargs: dict[str, Any]) -> ProgramState:
            program_kwargs, sampling = self._split({**defaults, **kwargs})
            state = ProgramState(_Executor(chosen, sampling, False))
            self._drive(state, (), program_kwargs)
            return state

        with ThreadPoolExecutor(workers, thread_name_prefix="radixserve-lang-batch") as pool:
            states = list(pool.map(one, items))
        if raise_errors:
            for state in states:
                err = state._exec.escaped or state._exec.unseen_error()
                if err is not None:
                    raise err
        return states

    def _drive(self, state: ProgramState, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Run the function on ``state``, then end every state of the run. Never raises: errors are kept in the
        root state (a branch error nobody read is moved there)."""
        executor = state._exec
        try:
            state.ret_value = self.fn(state, *args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - kept in the state, raised by run() or by a read
            executor.escaped = exc
            executor.fail(exc)
        finally:
            executor.end()
        err = executor.unseen_error()
        if err is not None and executor.error is None:
            executor.fail(err)

    def _split(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        program: dict[str, Any] = {}
        sampling: dict[str, Any] = {}
        for key, value in kwargs.items():
            if key in self._arg_names:
                program[key] = value
            elif key in SAMPLING_KEYS:
                sampling[key] = value
            elif self._any_kwargs:
                program[key] = value
            else:
                raise TypeError(
                    f"{self.fn.__name__}: unexpected keyword argument {key!r} (neither a parameter of the program "
                    "nor a sampling parameter)"
                )
        return program, sampling_dict(sampling)

    @staticmethod
    def _backend(backend: Backend | None) -> Backend:
        chosen = backend or _default_backend
        if chosen is None:
            raise RuntimeError(
                "no backend: pass backend=RuntimeEndpoint(url) or call set_default_backend(RuntimeEndpoint(url))"
            )
        return chosen


def function(fn: Callable[..., Any]) -> Program:
    """Decorator: ``@function def prog(s, question): s += ...`` makes ``prog`` a ``Program``."""
    return Program(fn)
