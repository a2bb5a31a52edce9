"""GPTQ and AWQ checkpoints (``runtime/quantized_checkpoint.py``) from a tiny random model, written here in
AutoGPTQ's and AutoAWQ's formats.

The writer below packs levels, zeros (stored one less in GPTQ's ``gptq`` format) and scales as each format defines
them (AWQ: along the outputs, in its word order), independently of the loader's unpacking. Each quantized folder
has a float twin whose linear weights are the exact dequantization, so: served dense (``--quantization none``), a
quantized checkpoint gives the twin's greedy tokens; served as blocks, symmetric layers are ggml blocks holding
the exact weights, asymmetric ones differ only by the fp16 rounding of their offsets, and act-order ones are
re-quantized to Q8_0.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixserve.runtime.models.quant import reference_dequantize
from radixserve.runtime.quantized_checkpoint import AWQ_ORDER, QuantSpec, dequantize, to_blocks
from radixserve.runtime.sampling_params import SamplingParams
from tests.test_engine import make_engine
from tests.tiny_model import make_tiny_model

PROMPTS = ["The quick brown fox", "One, two, three,", "def add(a, b):", "hello world"]


def _pack(levels: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Levels (non-negative ints) packed ``32 / bits`` to an int32 word along ``dim``, lowest bits first."""
    per = 32 // bits
    lv = levels.to(torch.int64)
    if dim == 0:
        lv = lv.reshape(lv.shape[0] // per, per, lv.shape[1])
        words = sum(lv[:, j, :] << (bits * j) for j in range(per))
    else:
        lv = lv.reshape(lv.shape[0], lv.shape[1] // per, per)
        words = sum(lv[:, :, j] << (bits * j) for j in range(per))
    return (words - ((words >> 31) << 32)).to(torch.int32).contiguous()  # the unsigned word's bits as int32


def _pack_awq(levels: torch.Tensor) -> torch.Tensor:
    """[R, C] levels -> [R, C / 8] int32 words along C, word level i holding channel AWQ_ORDER[i] of its 8."""
    r, c = levels.shape
    return _pack(levels.reshape(r, c // 8, 8)[:, :, list(AWQ_ORDER)].reshape(r, c), 4, 1)


def quantize_gptq(
    w: torch.Tensor, bits: int, group: int, sym: bool, act_order: bool, gen: torch.Generator, awq: bool = False
):
    """(parts in GPTQ's ``gptq`` format, or AWQ's, and the exact float weight they encode) for w [N, K]."""
    n, k = w.shape
    top = (1 << bits) - 1
    perm = torch.randperm(k, generator=gen) if act_order else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[perm] = torch.arange(k) // group  # act-order: the inputs in perm's order form the groups
    groups = k // group
    scales = torch.empty(groups, n)
    zeros = torch.empty(groups, n, dtype=torch.int64)
    for g in range(groups):
        cols = w[:, g_idx == g]
        if sym:
            scale = cols.abs().amax(dim=1) / (top // 2) + 1e-6
            zero = torch.full((n,), (top + 1) // 2, dtype=torch.int64)
        else:
            lo, hi = cols.amin(dim=1), cols.amax(dim=1)
            scale = (hi - lo) / top + 1e-6
            zero = (-lo / scale).round().clamp(0, top).to(torch.int64)
        scales[g], zeros[g] = scale.half().float(), zero
    q = (w / scales[g_idx].t() + zeros[g_idx].t()).round().clamp(0, top).to(torch.int64)  # [N, K]
    exact = (q - zeros[g_idx].t()).float() * scales[g_idx].t()
    if awq:
        return {"qweight": _pack_awq(q.t()), "qzeros": _pack_awq(zeros), "scales": scales.half()}, exact
    parts = {
        "qweight": _pack(q.t(), bits, 0),
        "qzeros": _pack((zeros - 1) & top, bits, 1),
        "scales": scales.half(),
        "g_idx": g_idx.to(torch.int32),
    }
    return parts, exact


def write_gptq(tmp: Path, bits: int, group: int, sym: bool, act_order: bool, awq: bool = False) -> tuple[Path, Path]:
    """A GPTQ (or AWQ) folder and its float twin, from one tiny random model."""
    base = make_tiny_model(tmp / "base", seed=0, tie=False)
    twin, gptq = tmp / "twin", tmp / "gptq"
    shutil.copytree(base, twin)
    shutil.copytree(base, gptq)
    weights = load_file(base / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    float_w, gptq_w = {}, {}
    for name, w in weights.items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            parts, exact = quantize_gptq(w.float(), bits, group, sym, act_order, gen, awq)
            float_w[name] = exact
            prefix = name.removesuffix(".weight")
            gptq_w.update({f"{prefix}.{p}": t for p, t in parts.items()})
        else:
            float_w[name] = gptq_w[name] = w
    save_file(float_w, twin / "model.safetensors", metadata={"format": "pt"})
    save_file(gptq_w, gptq / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((gptq / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
        if awq
        else {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym, "desc_act": act_order,
              "checkpoint_format": "gptq"}
    )  # fmt: skip
    (gptq / "config.json").write_text(json.dumps(config))
    return gptq, twin


SPECS = {  # name: (bits, group, sym, act_order, awq)
    "4bit-sym": (4, 32, True, False, False),
    "4bit-asym": (4, 64, False, False, False),
    "8bit-sym": (8, 64, True, False, False),
    "4bit-act-order": (4, 32, True, True, False),
    "awq": (4, 32, False, False, True),
}


@pytest.mark.parametrize("name", SPECS)
def test_layers_map_onto_blocks(name: str) -> None:
    bits, group, sym, act_order, awq = SPECS[name]
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=gen)
    parts, exact = quantize_gptq(w, bits, group, sym, act_order, gen, awq)
    spec = QuantSpec("awq", 4, group, False, 0) if awq else QuantSpec("gptq", bits, group, act_order, 1)
    assert torch.equal(dequantize(parts, spec), exact)  # the loader's unpacking agrees with the writer's packing
    blocks, how = to_blocks(parts, spec)
    got = reference_dequantize(blocks)
    if act_order:
        assert (blocks.qtype, how) == ("Q8_0", "re-quantized")
        step = exact.reshape(48, -1, 32).abs().amax(-1, keepdim=True) / 127
        # half a step of rounding, plus the fp16 rounding of the step itself times a level of up to 127
        assert ((got - exact).reshape(48, -1, 32).abs() <= step * (0.5 + 127 * 2**-11) + 1e-6).all()
    elif sym:
        assert (blocks.qtype, how) == ({4: "Q4_0", 8: "Q8_0"}[bits], "exact")
        assert torch.equal(got, exact)
    else:
        assert (blocks.qtype, how) == ("Q4_1", "offsets rounded")
        torch.testing.assert_close(got, exact, rtol=0, atol=2e-3 * exact.abs().max().item())


@pytest.mark.parametrize("name", ["4bit-asym", "8bit-sym", "4bit-act-order", "awq"])
def test_dense_gptq_serves_as_its_float_twin(tmp_path: Path, name: str) -> None:
    gptq, twin = write_gptq(tmp_path, *SPECS[name])
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    outputs = {}
    for label, folder in (("twin", twin), ("gptq", gptq)):
        eng = make_engine(folder, dtype="float32", quantization="none")
        try:
            outputs[label] = [r["output_ids"] for r in eng.generate(PROMPTS, params)]
        finally:
            eng.shutdown()
    assert outputs["gptq"] == outputs["twin"]


def test_blocks_hold_the_exact_weights_of_a_symmetric_checkpoint(tmp_path: Path) -> None:
    """Served as blocks (the default), a symmetric 4-bit checkpoint's layers are Q4_0 blocks whose weights are
    exactly its float twin's (re-quantizing the twin could not promise that), and the engine serves it."""
    gptq, twin = write_gptq(tmp_path, 4, 32, True, False, False)
    expected = load_file(twin / "model.safetensors")
    eng = make_engine(gptq, dtype="float32")
    try:
        layers = eng.core.runner.model.model.layers
        for i, layer in enumerate(layers):
            for module, name in ((layer.mlp.down_proj, "mlp.down_proj"), (layer.self_attn.o_proj, "self_attn.o_proj")):
                w = module.quant
                assert w is not None and w.qtype == "Q4_0"
                assert torch.equal(w.dequantize(), expected[f"model.layers.{i}.{name}.weight"])
        out = eng.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
        assert all(len(r["output_ids"]) == 8 for r in out)
    finally:
        eng.shutdown()


def test_other_checkpoint_quantizations_are_refused(tmp_path: Path) -> None:
    base = make_tiny_model(tmp_path / "other", seed=0)
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "bits": 4}
    (base / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'bitsandbytes' is not supported; served: GPTQ"):
        make_engine(base)
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "version": "gemv"}
    (base / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="version 'gemv'"):
        make_engine(base)
