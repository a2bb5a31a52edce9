"""The in-process engine: a thread that runs ``EngineCore.step`` in a loop, and a thread-safe, asyncio-friendly
API around it.

Ownership: callers own nothing but their output sink. Everything else (requests, KV, the radix tree) belongs to
the engine thread; other threads talk to it only through the inbox queue, and it answers through the sinks.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from radixserve.constrained import CompiledGrammar, ConstraintSpec
from radixserve.runtime import envs
from radixserve.runtime.attention import AttentionBackend, attention_backend
from radixserve.runtime.config import EngineConfig
from radixserve.runtime.distributed import TensorParallelModel, finish_start, start_leader
from radixserve.runtime.draft_model import load_draft_model
from radixserve.runtime.engine_api import EngineAPI, Sink, final_output
from radixserve.runtime.engine_core import EngineCore
from radixserve.runtime.errors import EngineDeadError, EngineOverloadedError
from radixserve.runtime.grammar import GrammarSupport
from radixserve.runtime.kv_pool import KVPool
from radixserve.runtime.kv_tier import KVTier, TierConfig, model_key
from radixserve.runtime.loader import load_model
from radixserve.runtime.lora import load_adapter, load_adapters
from radixserve.runtime.lora_spec import LoRASpec
from radixserve.runtime.mapped_weights import WeightMover
from radixserve.runtime.memory import RESERVE_BYTES, activation_bytes, check_pool_fits, module_bytes, size_pool
from radixserve.runtime.model_runner import ModelRunner
from radixserve.runtime.request import ErrorCode, FinishReason, Req, ReqOutput
from radixserve.runtime.sampler import Sampler
from radixserve.runtime.sampling_params import SamplingParams

logger = logging.getLogger("radixserve.engine")

__all__ = ["Engine", "EngineDeadError", "EngineOverloadedError"]

STATS_LOG_INTERVAL_S = 10.0
# KV tier: seconds of copying the periodic save may take from the engine loop, and the whole save at shutdown.
PERSIST_STEP_BUDGET_S = 0.05
PERSIST_EXIT_S = 8.0


class Engine(EngineAPI):
    """``Engine(model=..., ...)`` loads the model and starts serving at once.

    Thread-safe: ``submit``/``abort``/``generate`` may be called from any thread, ``stream`` from any event loop.
    ``lean_tokenizer=True`` decodes with ``LeanTokenizer`` (no transformers import) where that is exact; the
    engine process uses it, since its front end holds transformers' tokenizer for chat templates.
    """

    def __init__(self, config: EngineConfig | None = None, *, lean_tokenizer: bool = False, **overrides: Any) -> None:
        config = replace(config, **overrides) if config is not None else EngineConfig(**overrides)
        self.config = config
        if config.node_rank != 0:
            raise ValueError("only node 0 runs the engine; other nodes run `radixserve serve ... --node-rank R`")
        tp_start = start_leader(config) if config.tp > 1 else None
        loaded = tp_start[0] if tp_start is not None else load_model(config, lean_tokenizer=lean_tokenizer)
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.model_folder = loaded.folder
        self.load_seconds = loaded.load_seconds
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.pooling = loaded.pooling  # --runner pooling: the embeddings served (None: text; never under --tp)
        args = loaded.args
        self.vocab_size = args.vocab_size
        kv_heads = args.num_kv_heads // config.tp  # each rank holds its KV heads' shard of every slot
        per_token = KVPool.bytes_per_token(args.num_layers, kv_heads, args.head_dim, loaded.dtype)
        draft = load_draft_model(config, loaded, lean_tokenizer) if config.speculative_algorithm == "draft" else None
        # The draft model's pool has as many slots as the target's: its weights and per-token bytes join the sizing.
        # So do the LoRA adapters, all resident: loaded before the pool is sized.
        loras = load_adapters(config.lora_modules, loaded.model, loaded.dtype, loaded.device)
        side_weights = module_bytes(draft.model) if draft is not None else 0
        side_weights += loras.nbytes
        draft_per_token = draft.kv_bytes_per_token() if draft is not None else 0
        sizing = None

        def make_attention() -> AttentionBackend:
            return attention_backend(
                config.deterministic_inference, loaded.device, loaded.dtype, args.attn_softcap, config.attention_backend
            )

        if config.max_total_tokens:
            num_slots = config.max_total_tokens
            check_pool_fits(num_slots, per_token * (config.tp if loaded.device.type == "cpu" else 1), loaded.device)
        else:
            # On CPU every rank's weights and KV shard live in the same RAM; a GPU rank has its own memory.
            sharing = config.tp if loaded.device.type == "cpu" else 1
            weights = module_bytes(loaded.model) * sharing + side_weights
            reserve = RESERVE_BYTES
            if loaded.device.type == "cuda" and config.tp == 1:
                pool_args = (args.num_layers, kv_heads, args.head_dim, loaded.dtype, loaded.device)
                reserve = activation_bytes(loaded.model, make_attention, pool_args, config.chunked_prefill_size)
                logger.info("activations of a %d-token chunk: %.2f GiB (measured)", config.chunked_prefill_size,
                            reserve / 2**30)  # fmt: skip
            sizing = size_pool(
                config.mem_fraction_static, loaded.device, weights, per_token * sharing + draft_per_token, reserve
            )
            num_slots = sizing.slots
        graphs_on = loaded.device.type == "cuda" and config.tp == 1 and not config.disable_cuda_graph
        pool = KVPool(num_slots, args.num_layers, kv_heads, args.head_dim, loaded.dtype, loaded.device,
                      scratch_slots=int(graphs_on), on_huge_pages=loaded.pooling is None)  # fmt: skip
        self._tp: TensorParallelModel | None = finish_start(*tp_start, num_slots) if tp_start is not None else None
        context = config.max_context_len or args.max_position_embeddings
        self.max_context_len = min(context, args.max_position_embeddings)
        if context > args.max_position_embeddings:
            logger.warning(
                "--max-context-len %d is more than the model's %d positions (max_position_embeddings): using %d",
                context, args.max_position_embeddings, self.max_context_len,
            )  # fmt: skip
        if num_slots < self.max_context_len:
            logger.warning(
                "the KV cache holds %d tokens, fewer than the context length %d: a request (prompt and output) is "
                "limited to %d tokens", num_slots, self.max_context_len, num_slots,
            )  # fmt: skip
        logger.info(
            "KV cache: %d tokens (%.1f MiB, %.1f KiB per token%s), context length %d, radix cache %s; %s",
            num_slots,
            pool.nbytes / 2**20,
            per_token / 1024,
            f" on each of {config.tp} tensor-parallel ranks" if config.tp > 1 else "",
            self.max_context_len,
            "off" if config.disable_radix_cache else "on",
            f"sized as {sizing.describe()}" if sizing is not None else "--max-total-tokens",
        )
        sampler = Sampler(args.vocab_size, sorted(loaded.eos_token_ids), loaded.device, seed=config.seed)
        model = self._tp if self._tp is not None else loaded.model
        attention = make_attention()
        graphs = None
        if graphs_on and attention.graph_capturable:
            from radixserve.runtime.cuda_graph import DecodeGraphs  # imports Triton

            max_bs = config.cuda_graph_max_bs or config.max_running_requests
            graphs = DecodeGraphs(loaded.model, pool, max_bs, self.max_context_len, loaded.device)
            graphs.capture()
        runner = ModelRunner(model, pool, attention, sampler, loaded.device, graphs, loras, loaded.classifier)
        tier = None
        if config.enable_hierarchical_cache:
            layout = (args.num_layers, kv_heads, args.head_dim)
            weights = f"dummy:{config.seed}" if config.load_format == "dummy" else "checkpoint"
            key = model_key(loaded.folder, loaded.dtype, config.quantization, layout, 0, config.tp, weights)
            directory = Path(config.hicache_dir).expanduser() if config.hicache_dir else envs.cache_dir() / "kv-tier"
            capacity = int(config.hicache_size * 2**30)
            tier = KVTier(TierConfig(directory, capacity, config.hicache_chunk_tokens, key), pool)
            logger.info(
                "KV tier: %s, up to %.1f GiB, chunks of %d tokens (%.1f MiB each)",
                tier.dir, config.hicache_size, config.hicache_chunk_tokens, tier.chunk_bytes / 2**20,
            )  # fmt: skip
        drafter = draft.drafter(config, num_slots, args.vocab_size) if draft is not None else None
        self.core = EngineCore(
            config,
            runner,
            loaded.tokenizer,
            loaded.eos_token_ids,
            args.vocab_size,
            self.max_context_len,
            tier,
            drafter,
            loaded.pooling,
        )
        self.grammar = GrammarSupport(
            loaded.tokenizer,
            args.vocab_size,
            sorted(loaded.eos_token_ids),
            workers=config.grammar_workers,
            timeout_s=config.grammar_compile_timeout,
            nice=config.grammar_nice,
        )
        self._inbox: queue.SimpleQueue[tuple[str, Any, Any]] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._unfinished = 0
        # Queue depth = adds still in the inbox + the engine's waiting and grammar queues (as the engine thread
        # last published them, under this lock). Admission moves requests out only after a step, so the bound
        # is never exceeded by new requests; retracted requests re-enter the queue and may push it past it.
        self._pending_adds = 0
        self._engine_queued = 0
        self._count_lock = threading.Lock()
        # Set (under the lock) once the loop has stopped taking work; the inbox is drained after that, and
        # nothing is put into it after it, so no request or call is ever left unanswered.
        self._closed = False
        self._ids = itertools.count()
        self._stop = threading.Event()
        self.error: str | None = None
        self._last_log = time.monotonic()
        self._last_persist = time.monotonic()
        self._last_generated = 0
        self._thread = threading.Thread(target=self._loop, name="radixserve-engine", daemon=True)
        self._thread.start()
        # Weights mapped from the checkpoint move into memory of their own while the engine serves.
        models = [loaded.model] + ([draft.model] if draft is not None else [])
        self.weight_mover = WeightMover(models, self._post)

    # --- public API ---------------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        """Serving: the loop runs, has not failed, and ``shutdown`` was not called."""
        return self._thread.is_alive() and self.error is None and not self._stop.is_set()

    @property
    def num_queued(self) -> int:
        """Requests accepted but not yet admitted into a batch (inbox, grammar queue and waiting queue)."""
        with self._count_lock:
            return self._pending_adds + self._engine_queued

    @property
    def num_unfinished(self) -> int:
        """Requests accepted and not finished yet (queued or running)."""
        with self._count_lock:
            return self._unfinished

    def compile(self, spec: ConstraintSpec) -> Future[CompiledGrammar]:
        """Start compiling a constraint (or take it from the cache). Callers that want a compile error before
        submitting (the HTTP server, to answer 400) wait on this future; ``submit`` reuses the same compilation."""
        return self.grammar.compile(spec)

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, sink: Sink, rid: str | None = None) -> str:
        """Queue one request; ``sink`` receives its ``ReqOutput`` messages on the engine thread (keep it cheap).

        Raises ``ValueError`` for a request that can never be served and ``EngineOverloadedError`` when
        ``config.max_queued_requests`` requests already wait for admission (running ones do not count). A
        constrained request waits in the grammar queue while its grammar compiles; a compile failure finishes it
        with an error.
        """
        if not self.alive:
            raise EngineDeadError(self.error or "the engine has shut down")
        prompt = [int(t) for t in prompt_ids]
        self.core.validate(prompt, params)
        rid = rid or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        req = Req(rid, prompt, params)
        if params.constraint is not None:  # (outside the lock: the first one builds the compiler, a second or so)
            req.grammar_future = self.grammar.compile(params.constraint)
        with self._count_lock:
            if self._closed:
                raise EngineDeadError(self.error or "the engine has shut down")
            queued = self._pending_adds + self._engine_queued
            if queued >= self.config.max_queued_requests:
                raise EngineOverloadedError(
                    f"the waiting queue is full ({queued} requests wait for admission, --max-queued-requests "
                    f"{self.config.max_queued_requests}); retry later"
                )
            self._unfinished += 1
            self._pending_adds += 1
            if req.grammar_future is not None and not req.grammar_future.done():
                req.grammar_future.add_done_callback(lambda _: self._inbox.put(("wake", None, None)))
            self._inbox.put(("add", req, sink))
        return rid

    def abort(self, rid: str) -> None:
        self._inbox.put(("abort", rid, None))

    def call(self, fn: Callable[[EngineCore], Any], timeout: float = 30.0) -> Any:
        """Run ``fn(core)`` on the engine thread between two steps and return its result."""
        if not self.alive:
            raise EngineDeadError(self.error or "the engine has shut down")
        fut: Future[Any] = Future()
        with self._count_lock:
            if self._closed:
                raise EngineDeadError(self.error or "the engine has shut down")
            self._inbox.put(("call", fn, fut))
        return fut.result(timeout)

    def server_info(self) -> dict[str, Any]:
        def collect(core: EngineCore) -> dict[str, Any]:
            return {
                "model": self.model_name,
                "num_running_requests": len(core.scheduler.running),
                "num_waiting_requests": len(core.scheduler.waiting),
                "kv_cache": core.kv_usage(),
                "cache_stats": {**core.stats.as_dict(), "evicted_tokens": core.cache.evicted_tokens},
                "kv_tier": core.cache.tier.info() if core.cache.tier is not None else None,
                "speculative": core.drafter.info() if core.drafter is not None else None,
                "lora_adapters": list(core.lora_names),  # (config's lora_modules: those given at start)
                "runner": "pooling" if self.pooling is not None else "generate",
                "grammar": {"queue": len(core.grammar_queue), **self.grammar.info()},
                "max_context_len": self.max_context_len,
                "device": str(self.device),
                "dtype": str(self.dtype).removeprefix("torch."),
                "config": asdict(self.config),
            }

        return self.call(collect)

    @property
    def lora_names(self) -> tuple[str, ...]:
        return self.core.lora_names

    def load_lora(self, name: str, path: str) -> tuple[str, ...]:
        """Read the adapter here (the caller's thread), then install it between two steps."""
        if not name.strip():
            raise ValueError("a LoRA adapter needs a name")
        if name in self.core.lora_names:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded; unload it first")
        if self.config.tp > 1:
            raise ValueError("LoRA adapters are not served with --tp > 1 yet")
        adapter = load_adapter(LoRASpec(name, path), self.core.runner.model, self.dtype, self.device)
        names = self.call(lambda core: core.load_lora(adapter))
        logger.info("LoRA adapter loaded: %s", adapter.describe())
        return names

    def unload_lora(self, name: str) -> tuple[str, ...]:
        names = self.call(lambda core: core.unload_lora(name))
        logger.info("LoRA adapter unloaded: %s", name)
        return names

    def flush_cache(self) -> bool:
        return self.call(lambda core: core.flush_cache())

    def check_kv(self) -> dict[str, int]:
        """Run the KV accounting check between two steps (raises ``RuntimeError`` on a leak); returns the usage."""

        def check(core: EngineCore) -> dict[str, int]:
            core.cache.check(core.scheduler.holders())
            return core.kv_usage()

        return self.call(check)

    def _post(self, fn: Callable[[], None]) -> Future[None]:
        """Run ``fn()`` on the engine thread between two steps, without waiting for it."""
        fut: Future[None] = Future()
        with self._count_lock:
            if self._closed or not self.alive:
                raise EngineDeadError(self.error or "the engine has shut down")
            self._inbox.put(("call", lambda _core: fn(), fut))
        return fut

    def shutdown(self, timeout: float = 10.0) -> None:
        self.weight_mover.stop()
        self._stop.set()
        self._inbox.put(("wake", None, None))
        self._thread.join(timeout)
        self.weight_mover.close(timeout)  # its swap waiting on the loop has failed by now
        self.grammar.close()
        if self._tp is not None:
            self._tp.close()

    # --- engine thread ------------------------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        try:
            while not self._stop.is_set():
                self._drain(block=not self.core.has_work())
                if self._stop.is_set():
                    break
                self._dispatch(self.core.step())
                self._publish_queue()
                self._maybe_log()
                self._maybe_persist()
        except Exception as exc:  # noqa: BLE001 - the loop must report why it died
            logger.exception("engine loop died")
            self.error = f"engine loop died: {type(exc).__name__}: {exc}"
        with self._count_lock:
            self._closed = True
        reason = FinishReason.ERROR if self.error else FinishReason.ABORT
        core = self.core
        reqs = core.scheduler.fail_all(reason, self.error)
        for req in core.grammar_queue:  # still compiling: never reached the scheduler
            req.finish_reason, req.error = reason, self.error
        reqs += core.grammar_queue
        core.grammar_queue = []
        self._dispatch([core._delta(req) or final_output(req) for req in reqs])
        self._fail_inbox()
        if core.cache.tier is not None:
            core.cache.save_at_exit(PERSIST_EXIT_S, save=self.error is None)

    def _maybe_persist(self) -> None:
        """Save the radix cache to the KV tier every ``--hicache-persist-interval`` seconds (a little at a time:
        what the writer has not caught up with waits for the next round)."""
        interval = self.config.hicache_persist_interval
        if self.core.cache.tier is None or not interval or time.monotonic() - self._last_persist < interval:
            return
        self.core.cache.persist(PERSIST_STEP_BUDGET_S)
        self._last_persist = time.monotonic()

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, a, b = item
            if kind == "add":
                self._add(a, b)
            elif kind == "abort":
                out = self.core.abort(a)
                if out is not None:
                    self._dispatch([out])
            elif kind == "call":
                try:
                    b.set_result(a(self.core))
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    b.set_exception(exc)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _add(self, req: Req, sink: Sink) -> None:
        """Hand a request to the core; one that cannot be added (a duplicate rid, a failure while setting it up)
        fails alone, and never takes the sink of the request that already has its rid."""
        try:
            if req.rid in self._sinks:
                raise ValueError(f"request id {req.rid!r} is already in use")
            self.core.add(req)
        except Exception as exc:  # noqa: BLE001 - one bad request must not stop the engine
            if not isinstance(exc, ValueError):
                logger.exception("request %s failed while being added", req.rid)
            if isinstance(exc, ValueError):
                req.fail(str(exc), ErrorCode.INVALID)
            else:
                req.fail(f"{type(exc).__name__}: {exc}")
            with self._count_lock:
                self._unfinished -= 1
            try:
                sink(final_output(req))
            except Exception:  # noqa: BLE001 - a broken consumer must not stop the engine
                logger.exception("output sink of %s failed", req.rid)
        else:
            self._sinks[req.rid] = sink
        finally:
            self._publish_queue(added=1)

    def _publish_queue(self, added: int = 0) -> None:
        """Tell ``submit`` how many requests wait in the engine (``added`` of the inbox's adds have moved in)."""
        core = self.core
        with self._count_lock:
            self._pending_adds -= added
            self._engine_queued = len(core.scheduler.waiting) + len(core.grammar_queue)

    def _dispatch(self, outputs: list[ReqOutput]) -> None:
        for out in outputs:
            sink = self._sinks.get(out.rid)
            if out.finished:
                self._sinks.pop(out.rid, None)
                with self._count_lock:
                    self._unfinished -= 1
            if sink is not None:
                try:
                    sink(out)
                except Exception:  # noqa: BLE001 - a broken consumer must not stop the engine
                    logger.exception("output sink of %s failed", out.rid)

    def _fail_inbox(self) -> None:
        """Answer what was sent but never taken: requests end like those in the engine (abort on shutdown, the
        loop's error if it died), calls fail with ``EngineDeadError``."""
        while True:
            try:
                kind, a, b = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                a.finish_reason = FinishReason.ERROR if self.error else FinishReason.ABORT
                a.error = self.error or "the engine has shut down"
                with self._count_lock:
                    self._pending_adds -= 1
                    self._unfinished -= 1
                b(final_output(a))
            elif kind == "call":
                b.set_exception(EngineDeadError(self.error or "the engine has shut down"))

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_log < STATS_LOG_INTERVAL_S:
            return
        core = self.core
        gen = core.stats.generated_tokens
        kv = core.kv_usage()
        if core.has_work() or gen != self._last_generated:
            spec = ""
            if core.stats.spec_steps:
                rate, per_step = 100 * core.stats.spec_acceptance_rate, core.stats.spec_tokens_per_step
                spec = f", spec accepted {rate:.0f}% ({per_step:.2f} tokens a verification)"
            logger.info(
                "running %d, waiting %d, KV used %.1f%% (cached %d), cache hit rate %.1f%%, gen %.1f tok/s%s",
                len(core.scheduler.running),
                len(core.scheduler.waiting),
                100.0 * kv["in_use_tokens"] / kv["total_tokens"],
                kv["cached_tokens"],
                100.0 * core.stats.cache_hit_rate,
                (gen - self._last_generated) / (now - self._last_log),
                spec,
            )
        self._last_log = now
        self._last_generated = gen
