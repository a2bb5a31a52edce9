"""The CUDA-graph runner's slot table (``runtime/cuda_graph.py``), on the CPU: a request's row holds its slots by
position, copied only where new; a request whose slots list was replaced is copied again; rows of requests that
left are reused. And ``--load-format dummy`` (random weights, no checkpoint read) serves."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from radixserve.runtime.cuda_graph import SlotTable  # noqa: E402
from radixserve.runtime.engine import Engine  # noqa: E402
from radixserve.runtime.request import Req  # noqa: E402
from radixserve.runtime.sampling_params import SamplingParams  # noqa: E402

SCRATCH = 99


def _req(rid: str, slots: list[int]) -> Req:
    req = Req(rid, [1, 2, 3], SamplingParams(max_new_tokens=4))
    req.slots = slots
    return req


def test_rows_hold_each_requests_slots_and_follow_new_lists() -> None:
    table = SlotTable(rows=2, width=8, scratch_slot=SCRATCH, device=torch.device("cpu"))
    a, b = _req("a", [5, 6, 7]), _req("b", [10, 11])
    ra, rb = table.sync([(a, 3), (b, 2)])
    assert ra != rb and table.pad_row == 2
    assert table.table[ra, :3].tolist() == [5, 6, 7] and table.table[rb, :2].tolist() == [10, 11]
    assert table.table[table.pad_row].tolist() == [SCRATCH] * 8
    a.slots.append(8)  # a decode step's new slot: only it is copied
    table.table[ra, 0] = -1  # a marker: a full copy would overwrite it
    assert table.sync([(a, 4)]) == [ra]
    assert table.table[ra, :4].tolist() == [-1, 6, 7, 8]
    a.slots = [20, 21, 22, 23]  # a cached prefix replaced the request's copies: a new list, copied whole
    table.sync([(a, 4)])
    assert table.table[ra, :4].tolist() == [20, 21, 22, 23]
    # A third request while both rows are taken: the row of the request not in this step is reused.
    c = _req("c", [30])
    rows = table.sync([(a, 4), (c, 1)])
    assert rows[0] == ra and rows[1] == rb and table.table[rb, 0].item() == 30
    # b comes back: it gets a row again and is copied whole.
    with pytest.raises(RuntimeError, match="rows"):
        table.sync([(a, 4), (c, 1), (b, 2)])
    table.sync([(a, 4), (b, 2)])
    with pytest.raises(ValueError, match="columns"):
        table.sync([(_req("d", list(range(9))), 9)])


def test_dummy_load_format_serves_random_weights(tiny_model_dir: Path) -> None:
    outs, embeds = [], []
    for seed in (3, 3, 4):
        eng = Engine(model=str(tiny_model_dir), device="cpu", max_total_tokens=512, load_format="dummy", seed=seed)
        try:
            params = {"max_new_tokens": 8, "temperature": 0}
            outs.append(eng.generate(input_ids=[1, 2, 3, 4], sampling_params=params)["output_ids"])
            embeds.append(eng.call(lambda core: core.runner.model.model.embed_tokens.weight.clone()))
        finally:
            eng.shutdown()
    assert len(outs[0]) == 8 and outs[0] == outs[1]
    assert torch.equal(embeds[0], embeds[1]) and not torch.equal(embeds[0], embeds[2])  # the seed makes them
    assert abs(embeds[0].std().item() - 0.02) < 0.002
    real = Engine(model=str(tiny_model_dir), device="cpu", max_total_tokens=512)
    try:
        checkpoint = real.call(lambda core: core.runner.model.model.embed_tokens.weight.clone())
    finally:
        real.shutdown()
    assert not torch.equal(embeds[0], checkpoint)


def test_a_graph_step_computes_what_the_eager_step_does(tiny_model_dir: Path) -> None:
    """``DecodeGraphs.run`` (not captured on the CPU: its forward runs eagerly, through the slot table and the
    decode kernel under the interpreter) against the ordinary step over the same pool, padding rows included."""
    from radixserve.runtime.attention.torch_ref import TorchReferenceBackend
    from radixserve.runtime.batch import BatchPlan, ScheduledChunk
    from radixserve.runtime.config import EngineConfig
    from radixserve.runtime.cuda_graph import DecodeGraphs
    from radixserve.runtime.kv_pool import KVPool
    from radixserve.runtime.loader import load_model
    from radixserve.runtime.model_runner import ModelRunner
    from radixserve.runtime.sampler import Sampler

    loaded = load_model(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32"))
    args, cpu = loaded.args, torch.device("cpu")
    pool = KVPool(64, args.num_layers, args.num_kv_heads, args.head_dim, torch.float32, cpu, scratch_slots=1)
    runner = ModelRunner(loaded.model, pool, TorchReferenceBackend(), Sampler(args.vocab_size, [], cpu), cpu)
    graphs = DecodeGraphs(loaded.model, pool, max_bs=4, max_context=32, device=cpu)
    reqs = [_req(f"r{i}", []) for i in range(3)]
    free = iter(range(64))
    for i, req in enumerate(reqs):  # prompts of 3, 4 and 5 tokens, prefilled on the ordinary path
        req.prompt_ids = list(range(1, 4 + i))
        req.slots = [next(free) for _ in req.prompt_ids]
    runner.run(BatchPlan(tuple(ScheduledChunk(r, 0, len(r.prompt_ids), True) for r in reqs)))
    for req in reqs:
        req.output_ids = [7]
        req.slots.append(next(free))
    plan = BatchPlan(tuple(ScheduledChunk(r, len(r.prompt_ids), len(r.prompt_ids) + 1, True) for r in reqs))
    with torch.inference_mode():
        ids, positions, meta = runner.build_metadata(plan)
        from radixserve.runtime.attention.base import ForwardContext

        want = loaded.model(ids, positions, ForwardContext(meta, pool, runner.backend)).clone()
        got = graphs.run(plan)  # 3 rows in the bucket of 4: one padding row
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _tiny_engine(folder: Path, overlapped: bool) -> Engine:
    """The tiny model's float32 engine; ``overlapped``: given (before any request) what a CUDA engine has, a pool
    with a scratch slot, the decode graphs (run eagerly here, their attention under the Triton interpreter) and the
    overlap."""
    eng = Engine(model=str(folder), device="cpu", max_total_tokens=512, dtype="float32")
    if overlapped:
        try:
            _with_graphs(eng)
        except BaseException:
            eng.shutdown()
            raise
    return eng


def _with_graphs(eng: Engine) -> None:
    from radixserve.runtime.cuda_graph import DecodeGraphs
    from radixserve.runtime.kv_pool import KVPool

    def patch(core) -> None:  # noqa: ANN001
        runner, old = core.runner, core.runner.pool
        pool = KVPool(old.num_slots, len(old.kv), old.num_kv_heads, old.head_dim, old.kv[0].dtype,
                      torch.device("cpu"), scratch_slots=1)  # fmt: skip
        runner.pool = pool
        runner.graphs = DecodeGraphs(runner.model, pool, max_bs=8, max_context=256, device=torch.device("cpu"))
        core.overlap = True

    eng.call(patch)


def test_overlapped_decode_gives_the_same_tokens_and_frees_every_slot(tiny_qwen_dir: Path) -> None:
    """Greedy requests with every way of ending (length, a stop token met part-way, a late arrival that breaks the
    chain) through graph steps launched one ahead of their results, against the same requests run plainly; then
    the KV accounting."""
    import threading

    from tests.test_engine import assert_all_free

    prompts = [[391, 218, 23, 135, 264], [301, 114, 261, 74], [131, 275, 364, 311, 78, 161], [54, 184], [34, 283, 10]]
    lengths = [30, 3, 25, 1, 9]
    results = []
    for overlap in (False, True):
        eng = _tiny_engine(tiny_qwen_dir, overlap)
        try:
            greedy = {"max_new_tokens": 30, "temperature": 0}
            first = eng.generate(input_ids=prompts[0], sampling_params=greedy)["output_ids"]
            stop = first[5]  # met part-way by the first request, which then stops there (a surprise to the overlap)
            params = [{"max_new_tokens": n, "temperature": 0, "stop_token_ids": [stop]} for n in lengths]
            start = threading.Event()
            late: dict = {}

            def arrive(late=late, eng=eng, start=start, greedy=greedy) -> None:  # noqa: ANN001
                start.wait(5)
                late["ids"] = eng.generate(input_ids=[9, 9, 9], sampling_params=greedy)["output_ids"]

            t = threading.Thread(target=arrive)
            t.start()
            start.set()
            outs = eng.generate(input_ids=prompts, sampling_params=params)
            t.join()
            results.append((first, [o["output_ids"] for o in outs], late["ids"]))
            chained = eng.call(lambda core: core.stats.overlapped_steps)
            assert (chained > 20) if overlap else chained == 0
            assert_all_free(eng)
            assert eng.alive
        finally:
            eng.shutdown()
    assert results[1] == results[0]
    assert len(results[0][1][0]) == first.index(stop) + 1  # stopped at the stop token, part-way


def test_an_abort_while_steps_are_in_flight_frees_its_slots(tiny_qwen_dir: Path) -> None:
    import threading

    from radixserve.runtime.sampling_params import SamplingParams
    from tests.test_engine import assert_all_free

    eng = _tiny_engine(tiny_qwen_dir, overlapped=True)
    try:
        done = threading.Event()
        got: list[int] = []
        box: dict = {}

        def sink(out) -> None:  # noqa: ANN001 - on the engine thread
            got.extend(out.token_ids)
            if len(got) >= 3 and "aborted" not in box:
                box["aborted"] = True
                eng.abort(box["rid"])
            if out.finished:
                box["reason"] = out.finish_reason
                done.set()

        box["rid"] = eng.submit([391, 218, 23], SamplingParams(max_new_tokens=200, temperature=0), sink)
        other = eng.generate(input_ids=[301, 114], sampling_params={"max_new_tokens": 40, "temperature": 0})
        assert done.wait(30)
        assert box["reason"] is not None and box["reason"].value == "abort" and 3 <= len(got) < 200
        assert len(other["output_ids"]) == 40
        assert_all_free(eng)
    finally:
        eng.shutdown()


def test_a_launch_that_fails_falls_back_to_the_plain_step(tiny_qwen_dir: Path) -> None:
    """A step the overlap fails to launch (first ones and chained ones) runs the plain way: same tokens, and the
    slot a failed lookahead took goes back."""
    from tests.test_engine import assert_all_free

    prompts = [[391, 218, 23, 135, 264], [301, 114, 261, 74], [54, 184]]
    greedy = {"max_new_tokens": 16, "temperature": 0}
    outs = []
    for faulty in (False, True):
        eng = _tiny_engine(tiny_qwen_dir, faulty)
        try:
            if faulty:
                calls = {"n": 0}

                def patch(core, calls=calls) -> None:  # noqa: ANN001
                    launch = core.runner.launch

                    def flaky(plan, tokens=None, calls=calls):  # noqa: ANN001, ANN202
                        calls["n"] += 1
                        if calls["n"] % 3 == 0:
                            raise RuntimeError("injected launch failure")
                        return launch(plan, tokens)

                    core.runner.launch = flaky

                eng.call(patch)
            outs.append([o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=greedy)])
            if faulty:
                assert calls["n"] >= 6 and eng.call(lambda core: core.stats.overlapped_steps) > 0
            assert_all_free(eng)
        finally:
            eng.shutdown()
    assert outs[1] == outs[0]
