"""Run the app with uvicorn on a free loopback port in a background thread (tests, notebooks, the DSL).

with ServerThread(create_app(engine, ServerConfig())) as srv:
    requests.get(srv.url + "/health")
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time

import uvicorn
from fastapi import FastAPI

from radixserve.server.app import attach_server
from radixserve.server.lifecycle import uvicorn_options

START_TIMEOUT_S = 30.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def reap(proc: subprocess.Popen) -> None:
    """Kill a server process a test started, if it is still running, and close its output pipe."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)
    if proc.stdout:
        proc.stdout.close()


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float = 120.0) -> None:
    """Poll ``url``/health of a server started as ``proc`` until it answers 200; fails (with what the process
    printed, when its output is piped) if it exits first or ``timeout_s`` passes."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else f"exited with {proc.returncode}"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not become ready"
        time.sleep(0.2)


class ServerThread:
    """uvicorn serving ``app`` on ``host:port`` (a free port by default) until ``stop()`` or context exit."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int | None = None, log_level: str = "warning"):
        self.host = host
        self.port = port or free_port(host)
        options = uvicorn_options(app.state.server.config)
        config = uvicorn.Config(app, host=host, port=self.port, log_level=log_level, **options)
        self.server = uvicorn.Server(config)
        attach_server(app, self.server)
        self.thread = threading.Thread(target=self.server.run, name="radixserve-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Shut down as on SIGTERM: requests in flight get the app's --shutdown-grace-period to finish."""
        self.server.should_exit = True
        self.thread.join(START_TIMEOUT_S + self.server.config.timeout_graceful_shutdown)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
