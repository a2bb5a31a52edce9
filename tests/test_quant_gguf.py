"""GGUF files' blocks: the lean reader and the ggml type table against gguf-py, the blocks rewritten for the kernels
(Q4_K as Q4_1, Q5_0 as Q8_0), the K-quants' decoding against gguf-py's, and a quantized tiny GGUF served end to end
against its own dequantization."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from radixserve.runtime.engine import Engine
from radixserve.runtime.model_source import resolve_model
from radixserve.runtime.models import quant
from radixserve.runtime.models.quant import QuantTensor, reference_dequantize
from radixserve.runtime.sampling_params import SamplingParams
from tests.test_quant import FIVE_BIT, QTYPES, _has_packed_kernel
from tests.tiny_model import write_tiny_gguf


@pytest.fixture(scope="module")
def gguf_models(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    out = tmp_path_factory.mktemp("tiny-gguf")
    files = {q: write_tiny_gguf(tiny_model_dir, out / f"tiny.{q}.gguf", qtype=q) for q in ("Q8_0", "Q4_1", *FIVE_BIT)}
    yield files
    for path in files.values():  # the model cache's folders for these temporary files would only pile up
        shutil.rmtree(resolve_model(str(path)), ignore_errors=True)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", *FIVE_BIT])
def test_a_quantized_gguf_serves_its_blocks_and_matches_their_dequantization(
    gguf_models: dict[str, Path], qtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RADIXSERVE_CHECK_INTEGRITY", "1")
    path = gguf_models[qtype]
    prompts = [[5 + (7 * i + j) % 150 for j in range(9 + 3 * i)] for i in range(6)]
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    outs, weights = {}, {}
    for mode in ("auto", "none"):
        engine = Engine(model=str(path), device="cpu", max_total_tokens=2048, quantization=mode)
        try:
            outs[mode] = [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=params)]
            model = engine.core.runner.model
            weights[mode] = {
                type(m).__name__: m.qtype for m in model.modules() if getattr(m, "qtype", None) is not None
            }
            if mode == "auto":  # linear layers repack their blocks where the CPU runs the packed kernel
                packed = {type(m).__name__: m.qpacked for m in model.modules() if getattr(m, "qtype", None)}
                shared = model.lm_head.qdata.data_ptr() == model.model.embed_tokens.qdata.data_ptr()
            engine.check_kv()
        finally:
            engine.shutdown()
    # The 5-bit types are served as they are by the packed kernel; without it, as Q8_0 (Q5_0 exactly).
    served = qtype if qtype in QTYPES or qtype in quant.packed_types() else "Q8_0"
    assert weights["none"] == {} and set(weights["auto"].values()) == {served}
    assert weights["auto"].keys() >= {"Linear", "MergedLinear", "Embedding"}
    # The tiny model ties its head to the embedding: both read the head's one (packed) copy.
    assert packed == dict.fromkeys(("Linear", "MergedLinear", "Embedding"), _has_packed_kernel())
    assert shared
    assert outs["auto"] == outs["none"]


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_1"])
def test_the_lean_gguf_reader_reads_what_gguf_py_reads(tiny_model_dir: Path, tmp_path: Path, qtype: str) -> None:
    from radixserve.runtime.gguf_file import GGUFFile

    path = write_tiny_gguf(tiny_model_dir, tmp_path / f"tiny.{qtype}.gguf", qtype=qtype)
    theirs = gguf.GGUFReader(str(path))
    with GGUFFile(path) as ours:
        assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
        for a, b in zip(ours.tensors, theirs.tensors):
            assert (a.tensor_type, a.shape) == (int(b.tensor_type), tuple(int(d) for d in reversed(b.shape)))
            assert np.array_equal(ours.data(a), np.asarray(b.data).view(np.uint8).reshape(-1)), a.name
        for key, field in theirs.fields.items():
            if field.types and field.types[0] != gguf.GGUFValueType.ARRAY and not key.startswith("GGUF."):
                assert ours.metadata[key] == pytest.approx(field.contents()), key
    (tmp_path / "cut.gguf").write_bytes(path.read_bytes()[: path.stat().st_size - 100])
    with pytest.raises(ValueError, match="runs past the end of the file"):
        GGUFFile(tmp_path / "cut.gguf")


def test_q4_k_blocks_become_q4_1_blocks_of_the_same_weights() -> None:
    from radixserve.runtime.k_quants import q4_k_to_q4_1

    rng = np.random.default_rng(3)
    rows, k = 7, 768
    blocks = rng.integers(0, 256, size=(rows, k // 256, 144), dtype=np.uint8)  # any quants, scales and minimums
    for at, lo, hi in ((0, 1e-4, 0.05), (2, 1e-4, 0.02)):  # d and dmin: positive fp16, as llama-quantize writes
        blocks[..., at : at + 2] = rng.uniform(lo, hi, blocks.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
    raw = blocks.reshape(rows, -1)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K)
    got = reference_dequantize(QuantTensor("Q4_1", torch.from_numpy(q4_k_to_q4_1(raw)), (rows, k))).numpy()
    # Only the fp16 rounding of d * sc and dmin * m: half an fp16 ulp of each, times the quant (at most 15).
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    bound = np.repeat((d * 63 * 15 + dmin * 63) * 2.0**-11, 256, axis=-1).reshape(rows, k)
    assert np.all(np.abs(got - expected) <= bound + 1e-7)
    assert np.abs(got - expected).max() < 0.01 * np.abs(expected).max()


def test_q5_0_blocks_become_q8_0_blocks_of_exactly_the_same_weights(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from radixserve.runtime import gguf_weights
    from radixserve.runtime.gguf_weights import iter_gguf_weights
    from radixserve.runtime.k_quants import q5_0_to_q8_0
    from radixserve.runtime.weights import load_hf_config

    rng = np.random.default_rng(5)
    rows, k = 5, 96
    blocks = rng.integers(0, 256, size=(rows, k // 32, 22), dtype=np.uint8)  # any fifth bits and nibbles
    blocks[..., 0:2] = rng.uniform(-0.05, 0.05, blocks.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
    raw = blocks.reshape(rows, -1)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q5_0)
    got = reference_dequantize(QuantTensor("Q8_0", torch.from_numpy(q5_0_to_q8_0(raw)), (rows, k))).numpy()
    assert np.array_equal(got, expected)
    # A Q5_0 file's weights load as they are where the packed kernel serves Q5_0, else as Q8_0 blocks of the same
    # values (q and k rows back in HF's order either way).
    path = write_tiny_gguf(tiny_model_dir, tmp_path / "tiny.Q5_0.gguf", qtype="Q5_0")
    config = load_hf_config(tiny_model_dir)
    dense = dict(iter_gguf_weights(path, config, keep_quantized=False, progress=False))
    for packed in (quant.packed_types(), frozenset()):
        monkeypatch.setattr(gguf_weights, "packed_types", lambda served=packed: served)
        blocked = {n: v for n, v in iter_gguf_weights(path, config, progress=False) if isinstance(v, QuantTensor)}
        assert blocked and {v.qtype for v in blocked.values()} == {"Q5_0" if "Q5_0" in packed else "Q8_0"}
        for name, value in blocked.items():
            assert torch.equal(reference_dequantize(value), dense[name]), name


def test_q5_k_decodes_as_gguf_py_decodes_it() -> None:
    """ggml's block_q5_K: Q4_K's scales and nibbles with a fifth bit per weight (qh), any bits, positive d and dmin."""
    rng = np.random.default_rng(7)
    rows, k = 6, 512
    raw = rng.integers(0, 256, size=(rows, k // 256, 176), dtype=np.uint8)
    for at in (0, 2):
        raw[..., at : at + 2] = rng.uniform(1e-4, 0.01, size=(rows, k // 256, 1)).astype(np.float16).view(np.uint8)
    raw = raw.reshape(rows, -1)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q5_K))
    blocks = QuantTensor("Q5_K", torch.from_numpy(raw), (rows, k))
    assert torch.equal(reference_dequantize(blocks), expected)
    if "Q5_K" in quant.packed_types():
        assert torch.equal(blocks.pack().dequantize(), expected)


def test_the_ggml_type_table_is_gguf_pys() -> None:
    from radixserve.runtime.gguf_file import GGML_TYPES

    for type_id, (name, block, size) in GGML_TYPES.items():
        kind = gguf.GGMLQuantizationType(type_id)
        assert (kind.name, (block, size)) == (name, gguf.constants.GGML_QUANT_SIZES[kind])


def test_a_qwen2_gguf_keeps_its_query_and_key_rows(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    """llama.cpp interleaves q/k rows for the "llama" architecture only: a "qwen2" file (HF's rows, with q/k/v
    biases) served with its rows reordered anyway gave other logits and tokens than the checkpoint."""
    path = write_tiny_gguf(tiny_qwen_dir, tmp_path / "tiny-qwen2.gguf", name="tiny-qwen2")
    prompts = [[5 + (7 * i + j) % 150 for j in range(9 + 3 * i)] for i in range(4)]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    outs = []
    try:
        for model in (tiny_qwen_dir, path):
            engine = Engine(model=str(model), device="cpu", dtype="float32", quantization="none", max_total_tokens=2048)
            try:
                outs.append([r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=params)])
            finally:
                engine.shutdown()
    finally:
        shutil.rmtree(resolve_model(str(path)), ignore_errors=True)
    assert outs[0] == outs[1]
