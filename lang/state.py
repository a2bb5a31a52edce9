"""Program states: what ``s`` is inside a program.

Each state owns an executor: a worker thread that runs the state's operations (text, ``gen``, ``select``, role
markers) one by one, in the order they were appended. ``s += expr`` only queues work and returns at once; reading
(``s["x"]``, ``s.text()``, ...) waits until everything queued before has run. So ``for f in s.fork(4): f += gen()``
sends the four branches' requests concurrently, and the server batches them.

Invariants:
  * a state's text only grows, and only its own worker appends to it;
  * after an operation fails, the state's later operations are skipped and every read raises that error;
  * ``fork(n)`` snapshots the state after all its queued operations; the branches start from that text, and their
    first request waits until the shared prefix has been computed once (a prefill-only request), so every branch
    hits the prefix cache instead of recomputing it.
"""

from __future__ import annotations

import contextlib
import copy
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

from radixserve.lang.backend.base import Backend
from radixserve.lang.errors import BackendError, ChatTemplateError
from radixserve.lang.ir import ROLES, Atom, Expr, Gen, RoleBegin, RoleEnd, Select, flatten
from radixserve.lang.scoring import score_choices

_END = object()


class _Executor:
    """The worker behind one state. Fields marked (worker) change only on the worker thread, under ``_cond``."""

    def __init__(self, backend: Backend, defaults: dict[str, Any], stream: bool) -> None:
        self.backend = backend
        self.defaults = defaults
        self.stream = stream
        self.text = ""  # (worker)
        self.vars: dict[str, Any] = {}  # (worker)
        self.meta: dict[str, dict[str, Any]] = {}  # (worker)
        self.messages: list[dict[str, str]] = []  # (worker)
        self.role: tuple[str, int] | None = None  # (worker) the open turn and where its content starts
        self.turns = 0  # (worker) turns written so far
        self.error: BaseException | None = None
        self.error_seen = False
        # What escaped the program function: raised by run() even when a read inside the program raised it first
        # (``return s["var"]`` on a failed generation reads, and so "sees", the error it then lets escape).
        self.escaped: BaseException | None = None
        self.closed = False
        self.children: list[_Executor] = []
        self._cond = threading.Condition()
        self._log: list[tuple[str | None, str | None]] = []  # (var, text piece); (var, None) marks var complete
        self._pending = 0
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    # --- queue ----------------------------------------------------------------------------------------------
    def submit(self, op: Callable[[], None]) -> None:
        with self._cond:
            if self.closed:
                raise RuntimeError("this program state has ended: append to states only while their program runs")
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="radixserve-lang", daemon=True)
                self._thread.start()
        self._queue.put(op)

    def _work(self) -> None:
        while True:
            op = self._queue.get()
            if op is _END:
                return
            with self._cond:
                skip = self.error is not None
            failed: BaseException | None = None
            if not skip:
                try:
                    op()
                except BaseException as exc:  # noqa: BLE001 - kept and raised to whoever reads the state
                    failed = exc
            with self._cond:
                if failed is not None and self.error is None:
                    self.error = failed
                self._pending -= 1
                self._cond.notify_all()

    def wait(self) -> None:
        with self._cond:
            while self._pending:
                self._cond.wait()

    def check(self) -> None:
        with self._cond:
            err = self.error
            if err is not None:
                self.error_seen = True
        if err is not None:
            raise err

    def fail(self, exc: BaseException) -> None:
        with self._cond:
            if self.error is None:
                self.error = exc
            self._cond.notify_all()

    def end(self) -> None:
        """Run what is queued, then stop the worker. Branches end first (they may wait on this state's prefill)."""
        for child in list(self.children):
            child.end()
        with self._cond:
            if self.closed:
                return
            self.closed = True
            thread = self._thread
        if thread is not None:
            self._queue.put(_END)
            thread.join()
        with self._cond:
            self._cond.notify_all()

    def unseen_error(self) -> BaseException | None:
        """The first error in this state's tree that no read has raised yet."""
        if self.error is not None and not self.error_seen:
            return self.error
        return next((e for c in self.children if (e := c.unseen_error()) is not None), None)

    # --- operations (worker thread) -------------------------------------------------------------------------
    def _append(self, text: str, var: str | None = None) -> None:
        if text:
            with self._cond:
                self.text += text
                self._log.append((var, text))
                self._cond.notify_all()

    def _complete(self, name: str | None, value: Any, meta: dict[str, Any]) -> None:
        if name is not None:
            with self._cond:
                self.vars[name] = value
                self.meta[name] = meta
                self._log.append((name, None))
                self._cond.notify_all()

    def run_atom(self, atom: Atom) -> None:
        if isinstance(atom, str):
            self._append(atom)
        elif isinstance(atom, Gen):
            self._gen(atom)
        elif isinstance(atom, Select):
            res = score_choices(self.backend, self.text, atom.choices, atom.method)
            self._append(res.choice, atom.name)
            self._complete(atom.name, res.choice, res.meta)
        elif isinstance(atom, RoleBegin):
            self._begin(atom.role)
        else:
            self._end(atom.role)

    def _gen(self, g: Gen) -> None:
        pieces: list[str] = []

        def on_text(piece: str) -> None:
            pieces.append(piece)
            self._append(piece, g.name)

        out = self.backend.generate(
            self.text,
            {**self.defaults, **g.sampling},
            return_logprob=g.return_logprob,
            top_logprobs_num=g.top_logprobs_num,
            on_text=on_text if self.stream else None,
        )
        streamed = "".join(pieces)
        if not out.text.startswith(streamed):
            raise BackendError(f"the streamed text {streamed!r} is not a prefix of the final text {out.text!r}")
        self._append(out.text[len(streamed) :], g.name)
        self._complete(g.name, out.text, out.meta)

    def _begin(self, role: str) -> None:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
        if self.role is not None:
            raise ChatTemplateError(f"cannot open a {role} turn inside the open {self.role[0]} turn")
        self._append(self.backend.role_markers().begin(role, first=self.turns == 0))
        self.role = (role, len(self.text))

    def _end(self, role: str) -> None:
        if self.role is None or self.role[0] != role:
            open_role = self.role[0] if self.role else None
            raise ChatTemplateError(f"cannot close a {role} turn: the open turn is {open_role}")
        content = self.text[self.role[1] :]
        self._append(self.backend.role_markers().end(role))
        with self._cond:
            self.messages.append({"role": role, "content": content})
            self.role = None
            self.turns += 1

    # --- fork -----------------------------------------------------------------------------------------------
    def fork(self, n: int) -> list[_Executor]:
        if n < 1:
            raise ValueError(f"fork needs n >= 1, got {n}")
        self.wait()
        self.check()
        prefix = self.text
        gate: Future[None] = Future()
        if n > 1 and prefix:
            threading.Thread(
                target=_settle, args=(gate, lambda: self.backend.prefill(prefix)), name="radixserve-lang-prefill",
                daemon=True,
            ).start()
        else:
            gate.set_result(None)
        kids = []
        for _ in range(n):
            kid = _Executor(self.backend, self.defaults, self.stream)
            kid.text, kid.role, kid.turns = prefix, self.role, self.turns
            kid.vars, kid.meta = dict(self.vars), copy.deepcopy(self.meta)
            kid.messages = [dict(m) for m in self.messages]
            kid._log = [(None, prefix)] if prefix else []
            kid.submit(gate.result)
            kids.append(kid)
        with self._cond:
            self.children.extend(kids)
        return kids

    # --- streaming reads ------------------------------------------------------------------------------------
    def pieces(self, name: str | None) -> Iterator[str]:
        """Text pieces as they are appended: all of them (``name=None``, until the program ends) or those of
        variable ``name`` (until it is complete)."""
        i = 0
        while True:
            with self._cond:
                while i >= len(self._log) and self.error is None and not (self.closed and not self._pending):
                    self._cond.wait()
                entries, i = self._log[i:], len(self._log)
                failed = self.error is not None
                finished = self.closed and not self._pending
            for var, piece in entries:
                if name is None and piece:
                    yield piece
                elif name is not None and var == name:
                    if piece is None:
                        return
                    yield piece
            if failed:
                self.check()
            if finished and i == len(self._log):
                if name is not None:
                    raise KeyError(f"the program ended without setting {name!r}")
                return


def _settle(gate: Future[None], fn: Callable[[], Any]) -> None:
    """Run ``fn`` and report its outcome to ``gate`` only: a failed prefill fails the branches (their first operation
    waits on the gate), not the parent, which goes on with its own operations meanwhile."""
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - handed to the branches through the future
        gate.set_exception(exc)
    else:
        gate.set_result(None)


class ProgramState:
    """The ``s`` of a program. ``s += expr`` appends; reads wait for what was appended before them."""

    def __init__(self, executor: _Executor, driver: threading.Thread | None = None) -> None:
        self._exec = executor
        self._driver = driver
        self.ret_value: Any = None  # what the program function returned (set when it returns)

    def __repr__(self) -> str:
        return f"ProgramState(vars={sorted(self._exec.vars)}, text_chars={len(self._exec.text)})"

    def __iadd__(self, expr: Expr) -> ProgramState:
        for atom in flatten(expr):
            self._exec.submit(lambda a=atom: self._exec.run_atom(a))
        return self

    def sync(self) -> None:
        """Wait until everything appended so far has run (and, for a streamed run, until the program ended);
        raise the state's error if an operation failed."""
        driver = self._driver
        if driver is not None and driver is not threading.current_thread():
            driver.join()
        self._exec.wait()
        self._exec.check()

    def __getitem__(self, name: str) -> Any:
        self.sync()
        if name not in self._exec.vars:
            raise KeyError(f"no variable {name!r}; this state has {sorted(self._exec.vars)}")
        return self._exec.vars[name]

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self._exec.vars

    def variables(self) -> dict[str, Any]:
        self.sync()
        return dict(self._exec.vars)

    def text(self) -> str:
        self.sync()
        return self._exec.text

    def messages(self) -> list[dict[str, str]]:
        """The role turns written so far, as ``{"role", "content"}`` dicts (markers stripped)."""
        self.sync()
        return [dict(m) for m in self._exec.messages]

    def get_meta_info(self, name: str) -> dict[str, Any]:
        """What the backend reported for variable ``name``: token counts, ``cached_tokens``, ``finish_reason``,
        logprobs if asked (``gen``); every choice's scores and token log-probabilities (``select``)."""
        self.sync()
        if name not in self._exec.meta:
            raise KeyError(f"no variable {name!r}; this state has {sorted(self._exec.meta)}")
        return copy.deepcopy(self._exec.meta[name])

    @property
    def error(self) -> BaseException | None:
        """The error that stopped this state, if any (without waiting)."""
        return self._exec.error

    def fork(self, n: int) -> ForkGroup:
        """``n`` states that continue from this one's current text (see the module docstring)."""
        return ForkGroup([ProgramState(kid) for kid in self._exec.fork(n)])

    def text_iter(self, name: str | None = None) -> Iterator[str]:
        """Yield text as it is generated: variable ``name``'s pieces until it is complete, or (no name) every
        piece appended to the state until the program ends. The pieces join to exactly the final value."""
        return self._exec.pieces(name)

    @contextlib.contextmanager
    def _turn(self, role: str) -> Iterator[ProgramState]:
        self._exec.submit(lambda: self._exec.run_atom(RoleBegin(role)))
        yield self
        self._exec.submit(lambda: self._exec.run_atom(RoleEnd(role)))

    def system(self) -> contextlib.AbstractContextManager[ProgramState]:
        """``with s.system(): s += ...`` writes a system turn."""
        return self._turn("system")

    def user(self) -> contextlib.AbstractContextManager[ProgramState]:
        """``with s.user(): s += ...`` writes a user turn."""
        return self._turn("user")

    def assistant(self) -> contextlib.AbstractContextManager[ProgramState]:
        """``with s.assistant(): s += gen(...)`` writes an assistant turn."""
        return self._turn("assistant")


class ForkGroup(Sequence[ProgramState]):
    """The branches of ``s.fork(n)``: index or iterate them; ``forks += expr`` appends to every branch."""

    def __init__(self, states: list[ProgramState]) -> None:
        self._states = states

    def __len__(self) -> int:
        return len(self._states)

    def __getitem__(self, index: int) -> ProgramState:  # type: ignore[override]
        return self._states[index]

    def __setitem__(self, index: int, state: ProgramState) -> None:
        """Only for ``forks[i] += expr`` (Python stores the branch back): a group's branches never change."""
        if state is not self._states[index]:
            raise TypeError("the branches of a fork cannot be replaced; append to them with forks[i] += ...")

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self._states)

    def __iadd__(self, expr: Expr) -> ForkGroup:
        for state in self._states:
            state += expr
        return self

    def join(self) -> None:
        """Wait for every branch; raise the first branch error."""
        for state in self._states:
            state.sync()
