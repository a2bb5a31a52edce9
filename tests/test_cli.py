"""The command line: flags and their ``RADIXSERVE_*`` variables, and what a bad value of either says."""

from __future__ import annotations

import socket

import pytest

from radixserve.runtime.config import EngineConfig, from_args
from radixserve.server import ServerConfig
from radixserve.server.cli import build_parser, main


def test_cli_flags_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXSERVE_API_KEY", "from-env")
    monkeypatch.setenv("RADIXSERVE_SHUTDOWN_GRACE_PERIOD", "2.5")
    monkeypatch.setenv("RADIXSERVE_ENGINE_PROCESS", "off")
    args = build_parser().parse_args(["serve", "--model", "m", "--port", "1234", "--max-total-tokens", "64"])
    server = from_args(ServerConfig, args)
    assert server == ServerConfig(port=1234, api_key="from-env", shutdown_grace_period=2.5, engine_process=False)
    assert from_args(EngineConfig, args).max_total_tokens == 64
    with pytest.raises(ValueError, match="chat-template"):
        ServerConfig(chat_template="no/such/template.jinja")


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_a_bad_variable_is_a_one_line_error_naming_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not a traceback, not for every command (``--help`` and other commands still work), and never a typo read
    as "off"; a value the config refuses names the variable that set it."""
    monkeypatch.setenv("RADIXSERVE_PORT", "abc")
    assert "--port: expected int, got 'abc' (from RADIXSERVE_PORT)" in _error(["serve", "--model", "m"], capsys)
    build_parser().parse_args(["serve", "--model", "m", "--port", "8000"])  # the flag wins: the variable is unused
    monkeypatch.delenv("RADIXSERVE_PORT")
    monkeypatch.setenv("RADIXSERVE_ENGINE_PROCESS", "flase")
    assert "RADIXSERVE_ENGINE_PROCESS='flase': expected 1/0" in _error(["serve", "--model", "m"], capsys)
    monkeypatch.delenv("RADIXSERVE_ENGINE_PROCESS")
    monkeypatch.setenv("RADIXSERVE_DTYPE", "fp8")
    assert "(set by RADIXSERVE_DTYPE='fp8')" in _error(["serve", "--model", "m"], capsys)
    assert "RADIXSERVE_DTYPE" not in _error(["serve", "--model", "m", "--dtype", "fp8"], capsys)


def test_a_port_in_use_fails_before_the_engine_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Status 1 and a line naming the port, without loading a model (an engine started first was left behind)."""
    import radixserve.runtime.engine_spawn as spawn

    def no_engine(*_: object, **__: object) -> None:
        raise AssertionError("the engine was started for a server that cannot listen")

    monkeypatch.setattr(spawn, "spawn_engine_process", no_engine)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert main(["serve", "--model", "m", "--port", str(taken.getsockname()[1])]) == 1


def test_the_model_given_twice_differently_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    """`radixserve serve A --model B` served A silently."""
    assert "the model is given twice" in _error(["serve", "a-model", "--model", "another"], capsys)
    assert "given twice" in _error(["serve", "a-model", "--model-path=another"], capsys)


def test_errors_name_the_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    assert _error(["serve", "--model", "m", "--port", "-1"], capsys).startswith("radixserve serve: error: --port")
    assert _error(["router"], capsys).startswith("radixserve router: error: --worker-urls")


def test_cors_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """Pages on this machine by default; named origins (vLLM's JSON list too); '' turns CORS off; credentials need
    names; an origin with a path is refused."""
    parse = lambda *flags: from_args(ServerConfig, build_parser().parse_args(["serve", *flags]))  # noqa: E731
    assert "http://localhost:*" in parse().allowed_origins and "*" not in parse().allowed_origins
    named = parse("--allowed-origins", "https://a.example", "https://b.example", "--allow-credentials")
    assert named.allowed_origins == ("https://a.example", "https://b.example") and named.allow_credentials
    assert parse("--allowed-origins", '["https://a.example", "https://b.example"]').allowed_origins == (
        "https://a.example",
        "https://b.example",
    )
    assert parse("--allowed-origins", "").allowed_origins == ()
    error = _error(["serve", "--allowed-origins", "*", "--allow-credentials"], capsys)
    assert "--allow-credentials needs the origins named" in error
    assert "no path" in _error(["serve", "--allowed-origins", "https://a.example/app"], capsys)
