"""Lean loading: tensors read into memory of their own (no file map kept resident), each linear weight held once
after packing, a tied head left unpacked, bfloat16 weights served plain mapped from the file instead of read, and
a tensor-parallel rank cutting its shard out of each tensor as it is read (including checkpoints that store q/k/v
and gate/up fused, and the experts of MoE models)."""

from __future__ import annotations

import gc
import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from radixserve.runtime import loader, safetensors_read
from radixserve.runtime.config import EngineConfig
from radixserve.runtime.engine import Engine
from radixserve.runtime.loader import load_model
from radixserve.runtime.mapped_weights import mapped_tensors
from radixserve.runtime.models.linear import Linear, onednn_usable, plain_bf16_weights
from radixserve.runtime.safetensors_read import Cut, iter_file, read_ahead
from radixserve.runtime.sampling_params import SamplingParams
from tests.tiny_model import make_tiny_model


def test_reader_gives_what_safetensors_gives(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 5, generator=gen),
        "bf16": torch.randn(4, 8, generator=gen).to(torch.bfloat16),
        "f16": torch.randn(7, generator=gen).to(torch.float16),
        "i64": torch.arange(6).reshape(2, 3),
        "bool": torch.tensor([True, False, True]),
        "u8": torch.arange(10, dtype=torch.uint8),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }
    file = tmp_path / "t.safetensors"
    save_file(tensors, str(file), metadata={"format": "pt"})
    got = dict(iter_file(file))
    with safe_open(str(file), framework="pt") as f:
        assert sorted(got) == list(f.keys())  # noqa: SIM118 - safe_open handles are not iterable
        for name in f.keys():  # noqa: SIM118
            want = f.get_tensor(name)
            assert got[name].dtype == want.dtype and got[name].shape == want.shape
            assert torch.equal(got[name], want)


def test_reader_reads_only_the_cut_a_rank_asks_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A scratch buffer of 3 rows: a column cut reads its rows in several blocks.
    monkeypatch.setattr(safetensors_read, "_SCRATCH_BYTES", 3 * 40 * 2)
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(10, 40, generator=gen).to(torch.bfloat16)
    b = torch.randn(10, generator=gen)
    file = tmp_path / "t.safetensors"
    save_file({"w": w, "b": b}, str(file))
    cases = [
        (Cut(rows=((5, 10),)), lambda t: t[5:]),  # a column-parallel shard: its rows
        (Cut(rows=((1, 3), (6, 8))), lambda t: torch.cat([t[1:3], t[6:8]])),  # pieces of a fused tensor
        (Cut(rows=((0, 10),), cols=(20, 40)), lambda t: t[:, 20:]),  # a row-parallel shard: its columns
        (Cut(rows=((2, 9),), cols=(3, 11)), lambda t: t[2:9, 3:11]),
        (Cut(rows=((8, 10),), out_rows=5), lambda t: torch.cat([t[8:], t.new_zeros((3, *t.shape[1:]))])),  # padded
        (Cut(rows=(), out_rows=10), torch.zeros_like),  # a bias another rank adds: nothing read
    ]
    for cut, want in cases:
        for name, full in (("w", w), ("b", b)):
            if cut.cols is not None and full.dim() == 1:
                with pytest.raises(ValueError, match="does not fit"):
                    list(iter_file(file, select=lambda n, _d, _s, cut=cut: cut))
                continue
            got = dict(iter_file(file, select=lambda n, _d, _s, cut=cut, name=name: cut if n == name else None))
            assert torch.equal(got[name], want(full)), (cut, name)
            assert torch.equal(cut.take(full), want(full)), (cut, name)  # the same cut of a tensor in memory
            other = "b" if name == "w" else "w"
            assert torch.equal(got[other], b if other == "b" else w)  # not selected: read whole
    # Into a destination of the cut's shape (a merged projection's rows, a pooled buffer).
    buffer = torch.full((12, 20), 7.0, dtype=torch.bfloat16)
    given = dict(
        iter_file(
            file,
            into=lambda n, d, shape: buffer[2:12] if n == "w" and shape == [10, 20] else None,
            select=lambda n, _d, _s: Cut(rows=((0, 10),), cols=(0, 20)) if n == "w" else None,
        )
    )
    assert given["w"].data_ptr() == buffer[2:].data_ptr() and torch.equal(buffer[2:], w[:, :20])
    assert torch.equal(buffer[:2], torch.full((2, 20), 7.0, dtype=torch.bfloat16))


def test_reader_names_the_file_and_tensor_when_the_file_is_damaged(tmp_path: Path) -> None:
    file = tmp_path / "t.safetensors"
    save_file({"a": torch.ones(4), "b": torch.ones(1000)}, str(file))
    data = file.read_bytes()
    file.write_bytes(data[:-100])
    with pytest.raises(ValueError, match=r"truncated: tensor 'b'"):
        list(iter_file(file))
    file.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(ValueError, match="unreadable safetensors header"):
        list(iter_file(file))
    file.write_bytes(b"\x01")
    with pytest.raises(ValueError, match="not a safetensors file"):
        list(iter_file(file))


def test_read_ahead_hands_over_in_order_raises_the_readers_error_and_stops_when_closed() -> None:
    def items(fail_at: int | None):
        for i in range(6):
            if i == fail_at:
                raise ValueError("disk on fire")
            yield f"t{i}", torch.full((1024,), float(i))

    assert [n for n, _ in read_ahead(items(None), budget=4096)] == [f"t{i}" for i in range(6)]
    with pytest.raises(ValueError, match="disk on fire"):
        list(read_ahead(items(3)))
    before = threading.active_count()
    reader = read_ahead(items(None), budget=0)
    assert next(reader)[0] == "t0"
    reader.close()  # the consumer stops early (a load that failed): the thread ends
    assert threading.active_count() == before


@pytest.mark.skipif(not onednn_usable(torch.float32), reason="oneDNN's packed linear is not usable here")
def test_packing_releases_each_plain_weight_but_a_tied_head_stays_plain(tiny_model_dir: Path) -> None:
    base = EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32")
    lean = load_model(base).model
    kept = load_model(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32", keep_plain_weights=True))
    assert lean.args.tie_word_embeddings
    for name, module in lean.named_modules():
        if not isinstance(module, Linear) or name == "lm_head":
            continue
        assert module.weight.device.type == "meta", name  # the packed copy is the weight now
        assert module._packed is not None and tuple(module.weight.shape) == (module.out_features, module.in_features)
    head = lean.lm_head
    assert head.weight is lean.model.embed_tokens.weight and head.pack() is None  # tied: one copy, not packed
    assert all(p.device.type == "cpu" for p in kept.model.parameters())
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for (name, a), (_, b) in zip(lean.named_modules(), kept.model.named_modules(), strict=True):
            if not isinstance(a, Linear):
                continue
            for rows in (1, 4, 40):  # the released layers answer as the plain ones do
                x = torch.randn(rows, a.in_features, generator=gen)
                torch.testing.assert_close(a(x), b(x), msg=name)


def _mapped_ranges(file: Path) -> list[tuple[int, int]]:
    """The address ranges this process maps ``file`` at."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(file)):
            lo, hi = line.split()[0].split("-")
            ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


@pytest.mark.skipif(not plain_bf16_weights(), reason="bfloat16 weights are packed for oneDNN on this CPU")
def test_bfloat16_checkpoints_are_mapped_and_their_linear_weights_packed_from_the_map(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bfloat16 checkpoint is read through the file's map (no copy): each linear weight packs from it in pairs of
    K (``csrc/bf16_packed.cpp``; q/k/v, apart in the file, as parts in the model's order) and its mapped pages go
    back; the embedding stays a view of the map until the engine moves it into memory of its own and lets the map
    go. Greedy tokens are those of the same weights read into memory."""
    from safetensors.torch import load_file as load_tensors

    folder = make_tiny_model(tmp_path / "m", num_layers=2, tie=False, seed=5)
    (file,) = folder.glob("*.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(file).items()}, str(file), metadata={"format": "pt"})
    model = load_model(EngineConfig(model=str(folder), device="cpu", dtype="bfloat16")).model
    ranges = _mapped_ranges(file)
    assert ranges, "the checkpoint is not mapped"

    def in_map(t: torch.Tensor) -> bool:
        return any(lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= hi for lo, hi in ranges)

    layer = model.model.layers[0]
    stored = load_tensors(str(file))
    for linear, names in (
        (layer.self_attn.qkv_proj, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        (layer.mlp.gate_up_proj, ("mlp.gate_proj", "mlp.up_proj")),
        (layer.self_attn.o_proj, ("self_attn.o_proj",)),
    ):
        assert linear._released and linear._bf16_packed and not linear._plain_parts
        assert linear.weight.device.type == "meta" and not in_map(linear._packed)
        whole = torch.cat([stored[f"model.layers.0.{n}.weight"] for n in names]).float()
        x = torch.randn(5, whole.shape[1]).to(torch.bfloat16)
        want = torch.nn.functional.linear(x.float(), whole)
        with torch.inference_mode():
            got = linear(x).float()
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    assert in_map(model.model.embed_tokens.weight) and model.lm_head._bf16_packed
    assert not in_map(layer.input_layernorm.weight)  # read: a norm is not a matrix the kernels read in place
    assert len(mapped_tensors([model])) == 1  # the embedding: every linear weight is packed
    del model, layer, linear, stored
    gc.collect()
    assert not _mapped_ranges(file), "the map outlived the model"

    prompts = ["def fibonacci(n):", "The quick brown fox", "1, 2, 3, 4,"]
    outputs = []
    for mapping in (True, False):
        monkeypatch.setattr(loader, "plain_bf16_weights", lambda mapping=mapping: mapping)
        engine = Engine(model=str(folder), device="cpu", dtype="bfloat16", max_total_tokens=1024)
        try:
            assert engine.weight_mover.done.wait(30)
            assert engine.weight_mover.moved_bytes > 0 if mapping else engine.weight_mover.moved_bytes == 0
            gc.collect()
            assert not mapped_tensors([engine.core.runner.model]) and not _mapped_ranges(file)
            outputs.append(_greedy(engine, prompts))
        finally:
            engine.shutdown()
    assert outputs[0] == outputs[1] and all(outputs[0])


@pytest.mark.skipif(not plain_bf16_weights(), reason="bfloat16 weights are packed for oneDNN on this CPU")
def test_a_tied_head_packs_for_its_embedding_too(tmp_path: Path) -> None:
    """A head tied to the embedding packs in pairs like any linear weight, and the embedding looks its rows up in
    that one packed copy (the file's rows, bit for bit): nothing is left mapped, nothing moves."""
    folder = make_tiny_model(tmp_path / "m", num_layers=1, tie=True, seed=6)
    (file,) = folder.glob("*.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(file).items()}, str(file), metadata={"format": "pt"})
    stored = load_file(file)["model.embed_tokens.weight"].clone()
    engine = Engine(model=str(folder), device="cpu", dtype="bfloat16", max_total_tokens=256)
    try:
        model = engine.core.runner.model
        embed = model.model.embed_tokens
        assert model.lm_head._bf16_packed and embed._bf16_rows is model.lm_head._packed
        assert engine.weight_mover.done.wait(30) and engine.weight_mover.moved_bytes == 0
        assert not mapped_tensors([model])
        ids = torch.tensor([[0, 5, stored.shape[0] - 1], [17, 16, 15]])
        assert torch.equal(embed(ids), stored[ids])
        with pytest.raises(RuntimeError, match="out of range"):
            embed(torch.tensor([stored.shape[0]]))
        assert _greedy(engine, ["The quick brown fox"])[0]
    finally:
        engine.shutdown()


@pytest.mark.skipif(not plain_bf16_weights(), reason="bfloat16 weights are packed for oneDNN on this CPU")
def test_a_tied_head_that_stays_plain_moves_with_its_embedding(tmp_path: Path) -> None:
    """The mover swaps a tensor in all its owners at once: a tied head that does not pack (a vocabulary that is not
    a multiple of 16) stays the embedding."""
    folder = make_tiny_model(tmp_path / "m", num_layers=1, tie=True, seed=6, vocab_size_hint=501)
    (file,) = folder.glob("*.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(file).items()}, str(file), metadata={"format": "pt"})
    engine = Engine(model=str(folder), device="cpu", dtype="bfloat16", max_total_tokens=256)
    try:
        model = engine.core.runner.model
        assert model.model.embed_tokens.weight.shape[0] % 16, "the vocabulary must not pack"
        assert engine.weight_mover.done.wait(30) and engine.weight_mover.moved_bytes > 0
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert not mapped_tensors([model])
        assert _greedy(engine, ["The quick brown fox"])[0]
    finally:
        engine.shutdown()


def _greedy(engine: Engine, prompts: list[str]) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    return [r["output_ids"] for r in engine.generate(prompts, [params] * len(prompts))]


MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True}


@pytest.mark.parametrize(
    ("arch", "options"),
    [
        # Phi-3 checkpoints hold q/k/v and gate/up fused: each rank cuts its heads and its MLP slice out of each
        # piece of the fused tensor while reading it.
        ("phi3", {}),
        # Biased q/k/v and o projections (o's bias added by rank 0 only), an untied head, an odd vocabulary (the
        # last rank's shard padded).
        ("llama", {"qkv_bias": True, "tie": False, "vocab_size_hint": 501}),
        # Mixture of experts: the router whole on every rank, each expert split, one all-reduce per block.
        ("qwen3_moe", {"config_overrides": {"num_experts": 4, **MOE}}),
        ("mixtral", {"config_overrides": {"num_local_experts": 4, "num_experts_per_tok": 2}}),
    ],
)
def test_tp2_gives_one_process_greedy_tokens(tmp_path: Path, arch: str, options: dict) -> None:
    folder = make_tiny_model(tmp_path / arch, arch=arch, num_layers=2, seed=3, **options)
    if "vocab_size_hint" in options:
        assert json.loads((folder / "config.json").read_text())["vocab_size"] % 2 == 1
    prompts = ["def fibonacci(n):", "The quick brown fox", "1, 2, 3, 4,"]
    outputs = []
    for tp in (1, 2):
        engine = Engine(model=str(folder), device="cpu", max_total_tokens=1024, tp=tp)
        try:
            outputs.append(_greedy(engine, prompts))
        finally:
            engine.shutdown()
    assert outputs[0] == outputs[1] and all(outputs[0])


def test_a_sharded_checkpoint_reads_the_files_its_index_lists(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Mistral's repositories hold a ``consolidated.safetensors`` (the same weights in Mistral's own names) beside
    the HF shards and their index: only the index's files are weights (the other one failed the load)."""
    import shutil

    folder = tmp_path / "sharded"
    shutil.copytree(tiny_model_dir, folder)
    weights = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: weights[n] for n in part}, str(folder / file))
    weight_map = {n: file for file, part in shards.items() for n in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    save_file({"layers.0.attention.wk.weight": torch.zeros(4, 4)}, str(folder / "consolidated.safetensors"))
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    outs = []
    for model in (tiny_model_dir, folder):
        engine = Engine(model=str(model), device="cpu", dtype="float32", max_total_tokens=1024)
        try:
            outs.append(engine.generate(input_ids=[5, 6, 7, 8], sampling_params=params)["output_ids"])
        finally:
            engine.shutdown()
    assert outs[0] == outs[1]
