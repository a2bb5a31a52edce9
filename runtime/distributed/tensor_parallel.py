"""Starting tensor-parallel ranks, the leader's view of the sharded model, and the workers' command loop.

Start-up (``--tp N``, ``N / --nnodes`` ranks per node): node 0's process is rank 0, the leader, which runs the
engine; it spawns its node's other ranks as worker processes. Every other node runs ``radixserve serve ...
--node-rank R``, which spawns that node's ranks and waits (``run_worker_node``). Every rank joins the process
group at ``--dist-init-addr``, loads the full checkpoint and keeps its shard; the leader then sizes the KV pool
and sends ``("init", num_slots)``, and every rank allocates its shard of the pool (its KV heads).

Workers exit on ``("stop",)`` (at once, without finalizing the interpreter), when the leader's connection breaks,
and (local ones) when their parent dies.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from radixserve.runtime.attention import attention_backend
from radixserve.runtime.attention.base import ForwardContext
from radixserve.runtime.config import EngineConfig
from radixserve.runtime.distributed.group import (
    Groups,
    RankLayout,
    broadcast_command,
    device_for,
    gather_vocab,
    init_groups,
    threads_per_rank,
    to_device,
)
from radixserve.runtime.distributed.shard import check_shardable, shard_model
from radixserve.runtime.greedy import argmax_checked
from radixserve.runtime.kv_pool import KVPool
from radixserve.runtime.loader import LoadedModel, load_model, model_config, resolve_device, resolve_dtype
from radixserve.runtime.model_source import model_folder
from radixserve.runtime.models.llama import LlamaForCausalLM, ModelArgs
from radixserve.runtime.pooling import serves_embeddings

logger = logging.getLogger("radixserve.tp")

_CPU = torch.device("cpu")
WORKER_START_TIMEOUT_S = 600.0


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process is gone: no step can run any more (the engine stops)."""


def _free_addr() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def _spawn(config: EngineConfig, ranks: range, init_addr: str) -> list[Any]:
    ctx = mp.get_context("spawn")
    procs = []
    for rank in ranks:
        layout = RankLayout(rank=rank, world=config.tp, nnodes=config.nnodes)
        proc = ctx.Process(
            target=worker_main, args=(config, layout, init_addr, os.getpid()), name=f"radixserve-tp{rank}", daemon=True
        )
        proc.start()
        procs.append(proc)
    return procs


class TensorParallelModel:
    """The leader's handle on the sharded model, with the model runner's interface (``__call__`` and
    ``compute_logits``): each call first sends the command that makes every worker take the same step."""

    def __init__(
        self, model: LlamaForCausalLM, groups: Groups, procs: list[Any], vocab_size: int, threads: int
    ) -> None:
        self.model = model
        self.groups = groups
        self.procs = procs
        self.vocab_size = vocab_size
        self._threads = threads
        self._closed = False

    def _send(self, command: tuple[Any, ...]) -> None:
        dead = [p.name for p in self.procs if not p.is_alive()]
        if dead:
            raise WorkerDiedError(f"tensor-parallel worker(s) {', '.join(dead)} exited; restart the server")
        broadcast_command(command, self.groups.control)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        try:
            self._send(("forward", input_ids.to(_CPU), positions.to(_CPU), to_device(ctx.meta, _CPU)))
            return self.model(input_ids, positions, ctx)
        except dist.DistBackendError as exc:  # a rank vanished mid-collective: the group is broken for good
            raise WorkerDiedError(f"a tensor-parallel collective failed: {exc}") from exc

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        try:
            self._send(("logits", hidden.to(_CPU)))
            local = self.model.compute_logits(hidden)
            logits = gather_vocab(local, self.vocab_size, self.groups.model, leader=True)
        except dist.DistBackendError as exc:
            raise WorkerDiedError(f"a tensor-parallel collective failed: {exc}") from exc
        assert logits is not None  # the leader always gets the gathered logits
        return logits

    def greedy_tokens(self, hidden: torch.Tensor, vocab: int) -> torch.Tensor:
        return argmax_checked(self.compute_logits(hidden), vocab)

    def close(self, timeout: float = 30.0) -> None:
        """Stop every worker (those of other nodes exit too) and leave the process group."""
        if self._closed:
            return
        self._closed = True
        try:
            if all(p.is_alive() for p in self.procs):
                broadcast_command(("stop",), self.groups.control)
        finally:
            for p in self.procs:
                p.join(timeout)
                if p.is_alive():
                    p.kill()
            dist.destroy_process_group()
            torch.set_num_threads(self._threads)


def start_leader(config: EngineConfig) -> tuple[LoadedModel, Groups, list[Any], int]:
    """Rank 0: spawn this node's workers, join the group, load and shard the model. The caller sizes the KV pool
    and calls ``finish_start``."""
    folder = model_folder(config)
    hf_config = model_config(config, folder)
    check_shardable(ModelArgs.from_hf_config(hf_config), config.tp)
    if serves_embeddings(config.runner, folder, hf_config):  # (before any rank is started)
        raise ValueError("embeddings and scores (--runner pooling) are not served with --tp > 1 yet; serve with --tp 1")
    init_addr = config.dist_init_addr or _free_addr()
    layout = RankLayout(rank=0, world=config.tp, nnodes=config.nnodes)
    device = device_for(resolve_device(config.device), 0)
    # Every rank must compute in one dtype (a collective over tensors of two dtypes aborts the process): `auto` is
    # resolved once, here, and the workers get the result instead of reading their own CPU's flags.
    dtype = resolve_dtype(config.dtype, device, hf_config)
    config = replace(config, dtype=str(dtype).removeprefix("torch."))
    logger.info("tensor parallel: %d ranks on %d node(s), process group at %s", config.tp, config.nnodes, init_addr)
    procs = _spawn(config, range(1, layout.per_node), init_addr)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads_per_rank(layout.per_node))
        groups = init_groups(layout, init_addr, device)
        loaded = load_model(
            replace(config, device=str(device)), shard=lambda m: shard_model(m, 0, config.tp, groups.model)
        )
    except BaseException:
        for p in procs:
            p.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(threads)
        raise
    return loaded, groups, procs, threads


def finish_start(
    loaded: LoadedModel, groups: Groups, procs: list[Any], threads: int, num_slots: int
) -> TensorParallelModel:
    """Size every rank's KV shard; ``threads`` is the leader's thread count to restore on ``close``."""
    broadcast_command(("init", num_slots), groups.control)
    dist.barrier(group=groups.control)  # every rank has its shard of the pool
    return TensorParallelModel(loaded.model, groups, procs, loaded.args.vocab_size, threads)


def run_worker_node(config: EngineConfig) -> int:
    """``--node-rank R > 0``: run this node's ranks until the leader stops them; the exit status."""
    layout = RankLayout(rank=config.node_rank * (config.tp // config.nnodes), world=config.tp, nnodes=config.nnodes)
    first = layout.rank
    procs = _spawn(config, range(first, first + layout.per_node), config.dist_init_addr)
    logger.info("node %d: tensor-parallel ranks %d-%d started", config.node_rank, first, first + layout.per_node - 1)
    for p in procs:
        p.join()
    failed = [p for p in procs if p.exitcode]
    for p in failed:  # a negative exit code is the signal that ended the rank
        how = f"signal {-p.exitcode}" if p.exitcode < 0 else f"status {p.exitcode}"
        logger.error("node %d: %s ended with %s", config.node_rank, p.name, how)
    return 1 if failed else 0


def _exit_with(parent_pid: int) -> None:
    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(1.0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def worker_main(config: EngineConfig, layout: RankLayout, init_addr: str, parent_pid: int) -> None:
    """A worker rank: load and shard the model, allocate its KV shard, then execute the leader's commands."""
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s tp{layout.rank} %(levelname)s %(message)s")
    _exit_with(parent_pid)
    device = device_for(resolve_device(config.device), layout.local_rank)
    torch.set_num_threads(threads_per_rank(layout.per_node))
    groups = init_groups(layout, init_addr, device)
    loaded = load_model(
        replace(config, device=str(device)),
        shard=lambda m: shard_model(m, layout.rank, layout.world, groups.model),
    )
    model, args = loaded.model, loaded.args
    _, num_slots = broadcast_command(None, groups.control)
    kv_heads = args.num_kv_heads // layout.world
    pool = KVPool(num_slots, args.num_layers, kv_heads, args.head_dim, loaded.dtype, device)
    attention = attention_backend(
        config.deterministic_inference, device, loaded.dtype, args.attn_softcap, config.attention_backend
    )
    dist.barrier(group=groups.control)
    with torch.inference_mode():
        while True:
            command = broadcast_command(None, groups.control)
            if command[0] == "forward":
                _, input_ids, positions, meta = command
                ctx = ForwardContext(to_device(meta, device), pool, attention)
                model(input_ids.to(device), positions.to(device), ctx)
            elif command[0] == "logits":
                gather_vocab(model.compute_logits(command[1].to(device)), args.vocab_size, groups.model, False)
            elif command[0] == "stop":
                break
    # Leave without tearing the process group down: the leader destroys its side as soon as "stop" is sent, and a
    # gloo teardown racing with that once aborted a worker (std::terminate at exit), which its node reported as a
    # failed exit. A worker owns nothing that outlives it; only the log streams need flushing.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
