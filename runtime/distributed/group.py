"""Tensor-parallel ranks: how they are laid out over nodes and devices, and how the leader talks to the others.

One scheduler drives every rank. Rank 0 (the *leader*) runs the whole engine: scheduler, radix cache, grammars,
sampling. Every other rank (a *worker*) only executes the leader's commands in order, on its own shard of the
weights and of the KV pool (sharded by KV head): ``forward`` (one step's tokens, positions and attention
metadata) and ``logits`` (hidden rows to project; the vocabulary shards are gathered on the leader). Ranks cannot
diverge because no rank but the leader decides anything: tokens, grammar decisions and slot numbers all come
from it.

Commands travel by ``broadcast_object_list`` over a gloo group (CPU tensors; each worker moves them to its
device); model collectives run on the main group (NCCL on CUDA, gloo on CPU).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# Workers wait on the leader's next command for as long as the server idles, so collectives must not time out.
IDLE_TIMEOUT = datetime.timedelta(days=30)


@dataclass(frozen=True)
class RankLayout:
    """Where one rank sits: ``world`` ranks over ``nnodes`` nodes, ``per_node`` consecutive ranks per node."""

    rank: int
    world: int
    nnodes: int

    @property
    def per_node(self) -> int:
        return self.world // self.nnodes

    @property
    def local_rank(self) -> int:
        return self.rank % self.per_node

    @property
    def node_rank(self) -> int:
        return self.rank // self.per_node


def device_for(spec: torch.device, local_rank: int) -> torch.device:
    """Rank ``local_rank``'s device: its own GPU on CUDA, the CPU otherwise."""
    if spec.type == "cuda":
        return torch.device("cuda", local_rank)
    return spec


def threads_per_rank(per_node: int) -> int:
    """CPU threads for one rank when ``per_node`` ranks share this machine's cores."""
    return max(1, (os.cpu_count() or 1) // per_node)


@dataclass
class Groups:
    """The process groups of one rank: ``model`` for the weights' collectives, ``control`` for commands."""

    model: Any
    control: Any


def init_groups(layout: RankLayout, init_addr: str, device: torch.device) -> Groups:
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method=f"tcp://{init_addr}", rank=layout.rank, world_size=layout.world, timeout=IDLE_TIMEOUT
    )
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT) if backend == "nccl" else dist.group.WORLD
    return Groups(model=dist.group.WORLD, control=control)


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor inside (dataclasses, tuples, lists) moved to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(
            obj, **{f.name: to_device(getattr(obj, f.name), device) for f in dataclasses.fields(obj)}
        )
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(x, device) for x in obj)
    return obj


def broadcast_command(command: tuple[Any, ...] | None, control: Any) -> tuple[Any, ...]:
    """The leader sends ``command`` (CPU tensors inside); a worker passes ``None`` and gets it."""
    box = [command]
    dist.broadcast_object_list(box, src=0, group=control)
    return box[0]  # type: ignore[return-value]


def gather_vocab(local: torch.Tensor, vocab_size: int, group: Any, leader: bool) -> torch.Tensor | None:
    """Concatenate every rank's logit columns on the leader (cut to ``vocab_size``); workers get ``None``."""
    world = dist.get_world_size(group)
    if local.device.type == "cuda":
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local.contiguous(), group=group)  # NCCL has no gather to one rank
        return torch.cat(parts, dim=-1)[..., :vocab_size] if leader else None
    parts = [torch.empty_like(local) for _ in range(world)] if leader else None
    dist.gather(local.contiguous(), parts, dst=0, group=group)
    return torch.cat(parts, dim=-1)[..., :vocab_size] if parts is not None else None
