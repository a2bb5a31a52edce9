"""The DSL's logic against a scripted in-memory backend: role markers, token-space select, fork, streaming, errors,
batches. No model and no server; the real model is exercised in test_lang_real.py."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import jinja2
import pytest

from radixserve.lang import (
    Backend,
    BackendError,
    ChatTemplateError,
    GenOutput,
    assistant,
    function,
    gen,
    select,
    system,
    user,
)
from radixserve.lang.chat_template import derive_markers
from radixserve.lang.scoring import choice_spans

CHATML = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ '<|begin_of_text|>' }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
NO_SYSTEM = (  # Gemma-style: refuses a system role
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{{ '<start_of_turn>' + m['role'] + '\\n' + m['content'] + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
LAST_ONLY = "{{ messages[-1]['content'] }}"  # re-renders the conversation: turns cannot be appended


def _raise(msg: str) -> None:
    raise ValueError(msg)


def renderer(source: str) -> Callable[[list[dict[str, Any]], bool], str]:
    template = jinja2.Environment().from_string(source)
    return lambda messages, gen_prompt: template.render(
        messages=messages, add_generation_prompt=gen_prompt, raise_exception=_raise
    )


class FakeBackend(Backend):
    """Words with their leading space are tokens (as in BPE); a choice's log-probability comes from ``scores``."""

    def __init__(self, template: str = CHATML, reply: str = "fine answer", delay: float = 0.0) -> None:
        super().__init__()
        self.render = renderer(template)
        self.reply = reply
        self.delay = delay
        self.calls: list[tuple[str, Any]] = []
        self.scores: dict[str, float] = {}
        self.fail_on: str | None = None
        self.vocab: dict[str, int] = {}
        self._lock = threading.Lock()

    def _log(self, kind: str, value: Any) -> None:
        with self._lock:
            self.calls.append((kind, value))

    def generate(self, prompt, sampling, *, return_logprob=False, top_logprobs_num=0, on_text=None) -> GenOutput:
        self._log("generate", (prompt, dict(sampling)))
        if self.fail_on is not None and self.fail_on in prompt:
            raise BackendError("max_new_tokens must be >= 0, got -1", 400, "sampling_params.max_new_tokens")
        time.sleep(self.delay)
        pieces = re.findall(r" ?\S+", self.reply)
        if on_text is not None:
            for piece in pieces:
                on_text(piece)
                time.sleep(0.005)
        return GenOutput(self.reply, list(range(len(pieces))), {"completion_tokens": len(pieces)})

    def prefill(self, prompt: str) -> dict[str, Any]:
        self._log("prefill", prompt)
        time.sleep(self.delay)
        return {"prompt_tokens": len(prompt)}

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        with self._lock:
            return [
                [self.vocab.setdefault(t, len(self.vocab)) for t in re.findall(r" ?\w+| ?[^\w\s]+|\s+", s)]
                for s in texts
            ]

    def prompt_logprobs(
        self, input_ids: list[list[int]], start: int, routing_text: str | None = None
    ) -> list[list[float]]:
        self._log("prompt_logprobs", (input_ids, start))
        names = {v: k for k, v in self.vocab.items()}
        return [[self.scores.get(names[t], -5.0) for t in ids[start:]] for ids in input_ids]

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self.render(messages, add_generation_prompt)

    def server_info(self) -> dict[str, Any]:
        return {"cache_stats": {}}

    def flush_cache(self) -> None:
        pass


# --- role markers ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("template", [CHATML, LLAMA3])
def test_multi_turn_text_is_the_template_rendering(template: str) -> None:
    @function
    def chat(s, q1: str, q2: str) -> None:
        s += system("Be brief.")
        s += user(q1)
        s += assistant(gen("a1"))
        with s.user():
            s += q2
        with s.assistant():
            s += gen("a2")

    backend = FakeBackend(template)
    state = chat.run(q1="Hi there", q2="And then?", backend=backend)
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[2]["content"] == state["a1"] == "fine answer"
    assert state.text() == backend.render(messages, False)
    # Each generation saw the conversation so far plus the template's generation prompt.
    prompts = [p for kind, (p, _) in ((k, v) for k, v in backend.calls if k == "generate")]
    assert prompts[0] == backend.render(messages[:2], True)
    assert prompts[1] == backend.render(messages[:4], True)


def test_first_turn_without_system_gets_the_templates_default() -> None:
    @function
    def ask(s) -> None:
        s += user("Hello")

    backend = FakeBackend(CHATML)
    state = ask.run(backend=backend)
    assert state.text() == backend.render([{"role": "user", "content": "Hello"}], False)
    assert "You are a helpful assistant." in state.text()


def test_markers_of_templates() -> None:
    llama = derive_markers(renderer(LLAMA3))
    assert llama.start == "<|begin_of_text|>"
    assert llama.prefix["system"] == "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
    assert llama.suffix["user"] == "<|eot_id|>"
    gemma = derive_markers(renderer(NO_SYSTEM))
    assert not gemma.has_system and gemma.prefix["assistant"] == "<start_of_turn>model\n"
    with pytest.raises(ChatTemplateError, match="no separate system turn"):
        gemma.begin("system", first=True)
    with pytest.raises(ChatTemplateError, match="re-renders earlier turns"):
        derive_markers(renderer(LAST_ONLY))


def test_role_errors_surface() -> None:
    @function
    def nested(s) -> None:
        with s.user():
            s += user("inner")

    with pytest.raises(ChatTemplateError, match="inside the open user turn"):
        nested.run(backend=FakeBackend())

    @function
    def sys_on_gemma(s) -> None:
        s += system("x")

    with pytest.raises(ChatTemplateError, match="no separate system turn"):
        sys_on_gemma.run(backend=FakeBackend(NO_SYSTEM))


# --- select ---------------------------------------------------------------------------------------------------
def test_select_scores_tokens_after_the_common_token_prefix() -> None:
    backend = FakeBackend()
    backend.scores = {" yes": -0.5, " no": -2.0, " maybe": -1.0, " not": -0.1, " sure": -9.0}

    @function
    def pick(s, prompt: str, choices: list[str]) -> None:
        s += prompt + select("v", choices)

    # "Answer: " ends in a space token that the choice's own " yes" replaces; "Answer:" has no space at all.
    bare = ["yes", "no", "maybe", "not sure"]
    for prompt, choices in (("Answer: ", bare), ("Answer:", [" " + c for c in bare])):
        state = pick.run(prompt=prompt, choices=choices, backend=backend)
        meta = state.get_meta_info("v")
        assert meta["token_logprobs"] == [[-0.5], [-2.0], [-1.0], [-0.1, -9.0]]
        assert state["v"] == choices[0] and meta["scores"][0] == -0.5
        assert meta["scores"][3] == pytest.approx(-4.55)
        assert sum(meta["probs"]) == pytest.approx(1.0)
        assert state.text() == "Answer: yes"
    # One batched scoring request for all choices.
    assert sum(1 for kind, _ in backend.calls if kind == "prompt_logprobs") == 2


def test_select_methods() -> None:
    backend = FakeBackend()
    backend.scores = {" red": -1.0, " green": -1.5, " light": -0.1, " blue": -3.0}
    choices = ["red", "green light", "blue"]

    @function
    def pick(s, method: str) -> None:
        s += "Color: " + gen("c", choices=choices, choices_method=method)

    assert pick.run(method="normalized", backend=backend)["c"] == "green light"  # mean(-1.5, -0.1) = -0.8
    assert pick.run(method="greedy", backend=backend)["c"] == "red"  # best first token
    state = pick.run(method="unconditional", backend=backend)
    # Unconditional context is only the token before the choice, so the fake scores cancel out: a tie, first wins.
    assert state["c"] == "red" and state.get_meta_info("c")["scores"] == [0.0, 0.0, 0.0]


def test_greedy_select_between_a_choice_and_its_extension() -> None:
    """["yes", "yes please"]: the longer one used to win on every tie of the first token, however unlikely its
    next token; it now wins only if that token is likelier than not."""
    backend = FakeBackend()

    @function
    def pick(s) -> None:
        s += "Reply:" + select("r", ["yes", "yes please"], method="greedy")

    backend.scores = {" yes": -0.2, " please": -50.0}
    assert pick.run(backend=backend)["r"] == "yes"
    backend.scores = {" yes": -0.2, " please": -0.1}
    assert pick.run(backend=backend)["r"] == "yes please"


def test_select_scores_many_choices_in_batches() -> None:
    """1,500 choices were one request each at once: more than a server's queue holds (a 429 no retry fixes)."""
    backend = FakeBackend()
    choices = [f"c{i}" for i in range(1500)]

    @function
    def pick(s) -> None:
        s += "Pick:" + select("c", choices)

    backend.scores = {"c1234": 0.0}
    assert pick.run(backend=backend)["c"] == "c1234"
    sizes = [len(ids) for kind, (ids, _) in backend.calls if kind == "prompt_logprobs"]
    assert sum(sizes) == 1500 and max(sizes) <= 256


def test_select_validation() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        select("x", ["a", ""])
    with pytest.raises(TypeError, match="not one string"):
        select("x", "ab")
    with pytest.raises(ValueError, match="method"):
        select("x", ["a"], method="best")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="max_tokns"):  # checked with choices too (where none has an effect)
        gen("x", choices=["a", "b"], max_tokns=3)
    with pytest.raises(ValueError, match="needs a prompt"):
        choice_spans([], [[7]])


# --- fork, streaming, batches ---------------------------------------------------------------------------------
def test_fork_prefills_once_then_runs_branches_concurrently() -> None:
    backend = FakeBackend(delay=0.3)

    @function
    def tree(s, n: int) -> list[str]:
        s += "A long shared context. "
        forks = s.fork(n)
        for i, f in enumerate(forks):
            f += f"Branch {i}:" + gen("out", max_tokens=4)
        forks.join()
        return [f["out"] for f in forks]

    start = time.monotonic()
    state = tree.run(n=4, backend=backend)
    elapsed = time.monotonic() - start
    assert state.ret_value == ["fine answer"] * 4
    kinds = [kind for kind, _ in backend.calls]
    assert kinds == ["prefill"] + ["generate"] * 4  # the prefix first, once
    assert backend.calls[0][1] == "A long shared context. "
    assert elapsed < 0.3 + 4 * 0.3 - 0.2, elapsed  # branches overlapped
    assert {p for _, (p, _) in backend.calls[1:]} == {f"A long shared context. Branch {i}:" for i in range(4)}


def test_forks_plus_equals_and_nested_forks() -> None:
    @function
    def nested(s) -> list[list[str]]:
        s += "Root."
        forks = s.fork(2)
        forks += " Step" + gen("a")
        leaves = [f.fork(2) for f in forks]
        for group in leaves:
            group += " Leaf" + gen("b")
        return [[leaf.text() for leaf in group] for group in leaves]

    state = nested.run(backend=FakeBackend())
    assert state.ret_value == [["Root. Stepfine answer Leaffine answer"] * 2] * 2
    assert state.text() == "Root."


def test_streaming_pieces_join_to_the_final_value() -> None:
    @function
    def story(s) -> None:
        s += user("Tell me")
        s += assistant(gen("tale"))

    backend = FakeBackend(reply="once upon a time there was a cat")
    state = story.run(backend=backend, stream=True)
    pieces = list(state.text_iter("tale"))
    assert len(pieces) == 8 and "".join(pieces) == state["tale"] == backend.reply
    assert "".join(state.text_iter()) == state.text()


def test_run_batch_keeps_order_and_merges_sampling() -> None:
    backend = FakeBackend()

    @function
    def one(s, i: int) -> None:
        s += f"Item {i}:" + gen("x", max_tokens=3, stop="\n")

    states = one.run_batch([{"i": i} for i in range(32)], backend=backend, temperature=0.0, top_p=0.5)
    assert [s.text() for s in states] == [f"Item {i}:fine answer" for i in range(32)]
    sent = [p for kind, (_, p) in backend.calls if kind == "generate"]
    assert len(sent) == 32
    assert all(p == {"max_new_tokens": 3, "stop": ["\n"], "temperature": 0.0, "top_p": 0.5} for p in sent)
    with pytest.raises(TypeError, match="unexpected keyword argument 'tempreature'"):
        one.run(i=1, tempreature=0.5, backend=backend)


def test_constrained_parameters_pass_through() -> None:
    pydantic = pytest.importorskip("pydantic")

    class City(pydantic.BaseModel):
        name: str

    backend = FakeBackend()

    @function
    def structured(s) -> None:
        s += "Phone:" + gen("p", regex=r"\d{3}-\d{4}")
        s += "City:" + gen("c", json_schema=City)
        s += "Raw:" + gen("r", json_schema={"type": "integer"})

    structured.run(backend=backend)
    sent = [p for kind, (_, p) in backend.calls if kind == "generate"]
    assert sent[0] == {"regex": r"\d{3}-\d{4}"}
    assert '"name"' in sent[1]["json_schema"] and sent[2] == {"json_schema": '{"type": "integer"}'}


# --- errors ---------------------------------------------------------------------------------------------------
def test_backend_errors_surface_with_the_servers_message() -> None:
    backend = FakeBackend()
    backend.fail_on = "BAD"

    @function
    def prog(s, tail: str) -> None:
        s += "x " + tail + gen("a")
        s += gen("b")

    with pytest.raises(BackendError, match="max_new_tokens must be >= 0") as info:
        prog.run(tail="BAD", backend=backend)
    assert info.value.status == 400 and info.value.param == "sampling_params.max_new_tokens"
    assert sum(1 for kind, _ in backend.calls if kind == "generate") == 1  # later operations were skipped

    failed = prog.run_batch([{"tail": "ok"}, {"tail": "BAD"}], backend=backend, raise_errors=False)
    assert failed[0]["b"] == "fine answer" and isinstance(failed[1].error, BackendError)
    with pytest.raises(BackendError):
        failed[1].text()


def test_an_error_that_escapes_the_program_is_raised_even_after_a_read() -> None:
    """``return s["a"]`` on a failed generation reads the error (marking it seen) and lets it escape: run() and
    run_batch() used to return as if the program had succeeded."""
    backend = FakeBackend()
    backend.fail_on = "BAD"

    @function
    def prog(s, tail: str) -> str:
        s += "x " + tail + gen("a")
        return s["a"]

    with pytest.raises(BackendError, match="max_new_tokens"):
        prog.run(tail="BAD", backend=backend)
    with pytest.raises(BackendError, match="max_new_tokens"):
        prog.run_batch([{"tail": "ok"}, {"tail": "BAD"}], backend=backend)

    @function
    def reads_twice(s) -> str:
        s += "BAD" + gen("a")
        with contextlib.suppress(BackendError):
            s["a"]
        return s["a"]  # not caught this time

    with pytest.raises(BackendError):
        reads_twice.run(backend=backend)


def test_branch_errors_are_raised_unless_read() -> None:
    backend = FakeBackend()
    backend.fail_on = "BAD"

    @function
    def unread(s) -> None:
        s += "ctx "
        forks = s.fork(2)
        forks[0] += "ok" + gen("a")
        forks[1] += "BAD" + gen("a")

    with pytest.raises(BackendError):
        unread.run(backend=backend)

    @function
    def handled(s) -> str:
        s += "ctx "
        forks = s.fork(2)
        forks[1] += "BAD" + gen("a")
        try:
            return forks[1]["a"]
        except BackendError as exc:
            return f"handled: {exc.message}"

    assert handled.run(backend=backend).ret_value.startswith("handled: max_new_tokens")

    @function
    def python_error(s) -> None:
        s += "x"
        raise KeyError("from the program")

    with pytest.raises(KeyError, match="from the program"):
        python_error.run(backend=backend)
    streamed = python_error.run(backend=backend, stream=True)
    with pytest.raises(KeyError, match="from the program"):
        list(streamed.text_iter("never"))


def _one_shot_server(reply: bytes) -> str:
    """A loopback server that answers one request with ``reply`` (raw HTTP) and closes the connection."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        with conn, listener:
            request = b""
            while b"\r\n\r\n" not in request:
                request += conn.recv(65536)
            head, _, body = request.partition(b"\r\n\r\n")
            length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
            while len(body) < length:  # read it all: closing on unread data would reset the connection
                body += conn.recv(65536)
            conn.sendall(reply)

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}"


def test_runtime_endpoint_failures_are_backend_errors() -> None:
    """Values JSON cannot carry once read as "cannot reach the server"; a stream cut short raised requests' own
    exception instead of a BackendError."""
    from radixserve.lang import RuntimeEndpoint

    @function
    def prog(s, **kw: Any) -> None:
        s += "x" + gen("a", max_tokens=4, **kw)

    nowhere = RuntimeEndpoint("http://127.0.0.1:9")  # never contacted: the body fails to encode first
    with pytest.raises(BackendError, match="cannot be sent as JSON"):
        prog.run(backend=nowhere, temperature=float("nan"))
    with pytest.raises(BackendError, match="cannot be sent as JSON"):
        prog.run(backend=nowhere, stop={"x"})
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
    cut = _one_shot_server(head + b'data: {"text": "ab", "output_ids": [1, 2], "meta_info": {}}\n\n')
    state = prog.run(backend=RuntimeEndpoint(cut), stream=True)
    with pytest.raises(BackendError, match="ended without"):
        list(state.text_iter("a"))
    garbled = _one_shot_server(head + b"data: {not json\n\n")
    with pytest.raises(BackendError, match="not JSON"):
        list(prog.run(backend=RuntimeEndpoint(garbled), stream=True).text_iter("a"))
