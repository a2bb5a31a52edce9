"""Start the engine process: a fresh interpreter on one end of a socket pair, sent its ``ipc.Start`` at once.

A module of its own, importing next to nothing, so that ``radixserve serve`` starts the engine process (whose
``import torch`` is most of a start) before the front end imports its server, HTTP and tokenizer stack.
``EngineProcess`` takes the result over.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection

from radixserve.runtime import ipc
from radixserve.runtime.config import EngineConfig
from radixserve.runtime.logs import current_format


@dataclass
class Spawned:
    proc: subprocess.Popen
    conn: Connection
    config: EngineConfig


def spawn_engine_process(config: EngineConfig) -> Spawned:
    # Not multiprocessing's spawn, which re-imports the caller's __main__ and so breaks scripts without a main
    # guard; the child gets the caller's import path.
    ours, theirs = socket.socketpair()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixserve.runtime.engine_worker", str(theirs.fileno())],
        pass_fds=[theirs.fileno()],
        env=env,
    )
    theirs.close()
    conn = Connection(ours.detach())
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    conn.send(ipc.Start(config, level, current_format()))
    return Spawned(proc, conn, config)
