"""Typed messages between the front end and an engine in its own process (``runtime.engine_process``).

They cross a pipe pickled, so they hold plain data only: token ids, ``SamplingParams`` (a ``ConstraintSpec`` at
most, never a compiled grammar), ``ReqOutput`` deltas. Every request the front end sends is answered: an ``Add``
by ``Outputs`` ending in a finished ``ReqOutput``, a ``Compile`` or ``Call`` by a ``Reply``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from radixserve.runtime.request import ReqOutput
from radixserve.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from radixserve.constrained import ConstraintSpec
    from radixserve.runtime.config import EngineConfig
    from radixserve.runtime.pooling import PoolingModel

# --- front end -> engine ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Start:
    """The first message: what engine to build, and the front end's log level."""

    config: EngineConfig
    log_level: str
    log_format: str = "text"


@dataclass(frozen=True)
class Add:
    """Submit a request; the engine's outputs for ``rid`` follow in ``Outputs`` messages."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class Abort:
    rid: str


@dataclass(frozen=True)
class Compile:
    """Compile a constraint into the engine's grammar cache; the ``Reply`` carries the error, if any."""

    call_id: int
    spec: ConstraintSpec


CallName = Literal["server_info", "flush_cache", "check_kv", "load_lora", "unload_lora"]


@dataclass(frozen=True)
class Call:
    """One of the engine's queries or admin actions, run between two steps; ``args``: its arguments (strings)."""

    call_id: int
    name: CallName
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class Stop:
    """Shut the engine down (requests still running end with ``abort``) and exit."""


# --- engine -> front end ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineInfo:
    """What the front end needs to know of the loaded engine."""

    model_name: str
    vocab_size: int
    max_context_len: int
    kv_total_tokens: int
    dtype: str
    device: str
    pid: int
    pooling: PoolingModel | None = None  # --runner pooling: the embeddings served


@dataclass(frozen=True)
class Ready:
    info: EngineInfo


@dataclass(frozen=True)
class LoadFailed:
    """The engine could not be built; ``config_error`` marks a configuration mistake (a ``ValueError``)."""

    error: str
    config_error: bool


@dataclass(frozen=True)
class Outputs:
    """Output deltas (in order per request), and the engine's queue as of this message: ``queued`` requests wait
    for admission, and the engine has taken the first ``adds_taken`` ``Add`` messages it was sent."""

    outputs: list[ReqOutput]
    queued: int
    adds_taken: int


@dataclass(frozen=True)
class Reply:
    call_id: int
    value: Any = None
    error: BaseException | None = None


@dataclass(frozen=True)
class Died:
    """The engine loop stopped (a fault); ``error`` says why. Every request it held got its final output first."""

    error: str
