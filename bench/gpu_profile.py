"""The ``profile`` section of ``bench/gpu_check.py`` (``--only profile``): where a decode step's time goes on the
GPU (the graph replay alone, the decode kernel alone over tile choices, an eager step's kernels by GPU time, and an
engine step split into the runner's part and the rest)."""

from __future__ import annotations

import random
import time

from bench.gpu_common import Timed, section


@section("Profile: where a decode step's time goes (8B shape, 1K contexts)")
def check_profile(eng, bw: float) -> None:  # noqa: ANN001
    """The graph replay alone, the decode kernel alone in a few tile configurations, the kernels of an eager
    step by GPU time, and an engine step split into the runner's part and the rest (Python)."""
    import torch

    from radixserve.runtime.attention.triton_decode import decode_attention, num_splits
    from radixserve.runtime.engine_core import EngineCore
    from radixserve.runtime.model_runner import ModelRunner
    from radixserve.runtime.sampling_params import SamplingParams

    eng.call(lambda core: core.cache.flush())
    ctx = 1024

    def replay(core, batch: int) -> float:  # noqa: ANN001
        g = core.runner.graphs
        pool = core.runner.pool
        t = g.table
        rows = torch.arange(batch, device="cuda")
        t.table[:batch, :ctx] = torch.randperm(batch * ctx, device="cuda").view(batch, ctx).to(torch.int32)
        bs = next(x for x in g.buckets if x >= batch)
        host, h = g._next_host()
        g._pad(h, 0, bs)
        h[1, :batch] = ctx - 1
        h[2, :batch] = pool.scratch_slot
        h[3, :batch] = rows.tolist()
        h[4, :batch] = ctx
        g.io[:, :bs].copy_(host[:, :bs])
        graph, _ = g._graphs[bs]
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
        # The rows' table entries go back to nobody's: later requests rewrite them (each table row is synced anew).
        t._entries.clear()
        t._free = list(range(t.pad_row - 1, -1, -1))
        return (time.perf_counter() - start) / 20

    args = eng.call(lambda core: core.runner.model.args)
    weights = eng.call(lambda core: sum(p.numel() * p.element_size() for p in core.runner.model.parameters()))
    for batch in (1, 64, 256):
        dt = eng.call(lambda core, b=batch: replay(core, b))
        moved = weights + batch * ctx * 131072
        print(f"  graph replay alone, batch {batch:3d}: {dt * 1e3:6.2f} ms = {moved / dt / bw:.0%} of the roofline")

    # The decode kernel alone over one layer's pool.
    def kernel(core) -> None:  # noqa: ANN001
        pool = core.runner.pool
        kv = pool.kv[0]
        for batch in (64, 256):
            table = torch.randperm(batch * ctx, device="cuda").view(batch, ctx).to(torch.int32)
            q = torch.randn(batch, args.num_heads, args.head_dim, device="cuda", dtype=torch.bfloat16)
            rows = torch.arange(batch, device="cuda")
            lens = torch.full((batch,), ctx, device="cuda")
            kv_bytes = batch * ctx * args.num_kv_heads * args.head_dim * 2 * 2
            default = num_splits(batch, args.num_kv_heads, q.device)
            best = None
            for block_n in (32, 64, 128):
                for warps in (4,):
                    for stages in (3,):
                        for splits in (1, 2, 4):
                            run = lambda: decode_attention(q, kv, table, rows, lens, splits, 0.088,  # noqa: E731, B023
                                                           block_n=block_n, num_warps=warps, num_stages=stages)  # noqa: B023
                            try:
                                run()
                            except Exception as exc:  # noqa: BLE001 - a configuration that does not fit
                                print(f"    {block_n}/{warps}/{stages}/{splits}: {type(exc).__name__}")
                                continue
                            torch.cuda.synchronize()
                            start = time.perf_counter()
                            for _ in range(20):
                                run()
                            torch.cuda.synchronize()
                            dt = (time.perf_counter() - start) / 20
                            if best is None or dt < best[0]:
                                best = (dt, block_n, warps, stages, splits)
                            if (block_n, splits) == (128 if batch <= 64 else 64, default):
                                print(f"    batch {batch}, default tiles and splits ({splits}): {dt * 1e6:.0f} us = "
                                      f"{kv_bytes / dt / bw:.0%} of the copy bandwidth")  # fmt: skip
            dt, *cfg = best
            print(f"  decode kernel, batch {batch}: best {dt * 1e6:.0f} us (BLOCK_N/warps/stages/splits {cfg}) = "
                  f"{kv_bytes / dt / bw:.0%} of the copy bandwidth")  # fmt: skip

    eng.call(kernel, timeout=300)

    # An eager decode step of 64 rows under the profiler: GPU time by kernel.
    def eager(core) -> str:  # noqa: ANN001
        from radixserve.runtime.attention.base import AttentionMetadata, ForwardContext
        from radixserve.runtime.cuda_graph import GraphDecodeBackend

        g, batch = core.runner.graphs, 64
        io = g.io
        meta = AttentionMetadata(out_slots=io[2, :batch], num_decode=batch, decode_slots=None, decode_mask=None,
                                 extends=())  # fmt: skip
        backend = GraphDecodeBackend(g.table, io[3, :batch], io[4, :batch], num_splits(batch, 8, io.device))
        with torch.inference_mode(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                core.runner.model(io[0, :batch], io[1, :batch], ForwardContext(meta, core.runner.pool, backend))
            torch.cuda.synchronize()
        events = prof.key_averages()
        try:
            return events.table(sort_by="self_device_time_total", row_limit=14)
        except Exception:  # noqa: BLE001 - older torch names the column after CUDA
            return events.table(sort_by="self_cuda_time_total", row_limit=14)

    print(eng.call(eager, timeout=120))

    # An engine step, split: the runner's part (launch, sync, sample) and the rest (schedule, apply, outputs).
    timing = {"step": 0.0, "run": 0.0, "graph": 0.0, "n": 0}
    orig_step, orig_run = EngineCore.step, ModelRunner._run

    def step(self):  # noqa: ANN001, ANN202
        t = time.perf_counter()
        out = orig_step(self)
        timing["step"] += time.perf_counter() - t
        timing["n"] += 1
        return out

    def run(self, plan):  # noqa: ANN001, ANN202
        t = time.perf_counter()
        out = orig_run(self, plan)
        timing["run"] += time.perf_counter() - t
        return out

    rng = random.Random(5)
    for batch in (1, 64):
        prompts = [[rng.randrange(3, 49152) for _ in range(ctx)] for _ in range(batch)]
        Timed(eng).run(prompts, SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True))  # admit/compile
        EngineCore.step, ModelRunner._run = step, run
        timing.update(step=0.0, run=0.0, n=0)
        try:
            Timed(eng).run([p + [7] for p in prompts], SamplingParams(max_new_tokens=64, temperature=0,
                                                                     ignore_eos=True))  # fmt: skip
        finally:
            EngineCore.step, ModelRunner._run = orig_step, orig_run
        n = timing["n"]
        print(f"  engine, batch {batch}: {timing['step'] / n * 1e3:.2f} ms/step over {n} steps, of which the runner "
              f"{timing['run'] / n * 1e3:.2f} ms, the rest {(timing['step'] - timing['run']) / n * 1e3:.2f} ms")
        eng.call(lambda core: core.cache.flush())
