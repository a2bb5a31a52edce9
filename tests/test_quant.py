"""Block-quantized weights (Q8_0, Q4_0, Q4_1, the 5-bit types and the K-quants) served as they are: their decoding
against gguf-py's, the compiled kernels (row and packed layouts) against the PyTorch definition, our quantizers'
round trip, and a checkpoint quantized at load. GGUF files' blocks end to end: test_quant_gguf.py."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from radixserve.runtime.engine import Engine
from radixserve.runtime.models import quant
from radixserve.runtime.models.quant import QuantTensor, quantize_q4_1, quantize_q8_0, reference_dequantize

QTYPES = ["Q8_0", "Q4_0", "Q4_1"]  # the row kernel's types
FIVE_BIT = ["Q5_0", "Q5_1"]  # 32-weight blocks only the packed kernel takes
PACKED_QTYPES = [*QTYPES, *FIVE_BIT, "Q4_K", "Q5_K", "Q6_K"]


def _gguf_blocks(qtype: str, w: np.ndarray) -> tuple[QuantTensor, np.ndarray]:
    """``w`` quantized by gguf-py, as a QuantTensor, with gguf-py's own dequantization of it."""
    kind = gguf.GGMLQuantizationType[qtype]
    raw = gguf.quants.quantize(w, kind)
    blocks = QuantTensor(qtype, torch.from_numpy(np.ascontiguousarray(raw)).reshape(w.shape[0], -1), w.shape)
    return blocks, gguf.quants.dequantize(raw, kind)


@pytest.mark.parametrize("qtype", [*QTYPES, *FIVE_BIT])
def test_blocks_decode_as_gguf_py_decodes_them(qtype: str) -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 160)).astype(np.float32)
    blocks, expected = _gguf_blocks(qtype, w)
    assert torch.equal(reference_dequantize(blocks), torch.from_numpy(expected))
    assert torch.equal(blocks.dequantize(), torch.from_numpy(expected))  # the compiled unpacking, where built


def _layout(blocks: QuantTensor, layout: str) -> QuantTensor:
    """``blocks`` as ggml's rows, or packed in 16-channel groups (skipped where this CPU has no packed kernel)."""
    if layout == "rows":
        return blocks
    if quant.packed_ops() is None:
        pytest.skip("neither AVX-512 VNNI nor AVX2 on this CPU: weights keep their rows")
    _skip_unless_packed(blocks.qtype)
    packed = blocks.pack()
    assert packed.packed, f"{blocks.qtype} is not served packed here: {sorted(quant.packed_types())}"
    if blocks.qtype not in ("Q4_K", "Q5_K"):  # the same bytes, the last group padded
        assert packed.nbytes == -(-blocks.shape[0] // 16) * 16 * blocks.data.shape[1]
    return packed


def _skip_unless_packed(qtype: str) -> None:
    """Skip where the packed kernel of an optional type failed its start-up check on this CPU (the loader then serves
    that type as Q8_0; ``quant._packed_checked`` logs a warning). Only the AVX2 kernels of these types have run so
    far; the AVX-512 ones were compiled, not run."""
    if qtype in quant.OPTIONAL_PACKED_TYPES and qtype not in quant.packed_types():
        pytest.skip(f"the packed {qtype} kernel failed its start-up check on this CPU: served as Q8_0")


def _has_packed_kernel() -> bool:
    """Whether this CPU runs the packed kernel: AVX-512 VNNI, or else AVX2 with FMA and F16C."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    flags = set(text.split())
    return {"avx512f", "avx512bw", "avx512_vnni"} <= flags or {"avx2", "fma", "f16c"} <= flags


@pytest.mark.parametrize("qtype", [*QTYPES, *FIVE_BIT])
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 40])
@pytest.mark.parametrize("layout", ["rows", "packed"])
def test_quantized_linear_is_its_definition_and_close_to_the_dequantized_matmul(
    qtype: str, rows: int, layout: str
) -> None:
    """67 channels (a padded last group when packed) by 96 inputs (an odd number of blocks: a short last run)."""
    if layout == "rows" and qtype in FIVE_BIT:
        pytest.skip("the row kernel has no 5-bit types: the loader serves them packed or as Q8_0")
    rng = np.random.default_rng(1)
    rows_blocks, dense = _gguf_blocks(qtype, rng.standard_normal((67, 96)).astype(np.float32))
    blocks = _layout(rows_blocks, layout)
    x = torch.from_numpy(rng.standard_normal((rows, 96)).astype(np.float32))
    bias = torch.randn(67)
    got = quant.linear(x, blocks, bias)
    exact = x @ torch.from_numpy(dense).T + bias
    # The block kernel: int8 activations, as llama.cpp, whatever the number of rows.
    torch.testing.assert_close(got, quant.reference_linear(x, rows_blocks) + bias, rtol=1e-5, atol=1e-4)
    assert float((got - exact).norm() / exact.norm()) < 0.01  # the activations' rounding only (~0.5%)
    ids = torch.tensor([0, 66, 3, 3])
    assert torch.equal(quant.embedding(ids, blocks), torch.from_numpy(dense)[ids])
    assert torch.equal(blocks.dequantize(), torch.from_numpy(dense))


@pytest.mark.parametrize("qtype", PACKED_QTYPES)
def test_a_row_of_the_packed_kernel_does_not_depend_on_its_batch(qtype: str) -> None:
    """Speculative verification and deterministic inference rely on it: a row computed alone, in a batch of 2-13
    (every row-group size of the kernel) and at any place in it gives the same bits."""
    gen = torch.Generator().manual_seed(4)
    k = quant.weight_block(qtype) * 2
    blocks = _layout(quant._random_blocks(qtype, 40, k, gen), "packed")
    x = torch.randn(13, k, generator=gen)
    alone = torch.cat([quant.linear(x[i : i + 1], blocks) for i in range(13)])
    for m in range(2, 14):
        assert torch.equal(quant.linear(x[:m], blocks), alone[:m]), m
    assert torch.equal(quant.linear(x.flip(0), blocks), alone.flip(0))
    # bfloat16 rows: the same float32 sums, rounded once (no float32 copy of x is made for the kernel).
    xb = x.to(torch.bfloat16)
    assert torch.equal(quant.linear(xb, blocks), quant.linear(xb.float(), blocks).to(torch.bfloat16))


@pytest.mark.parametrize("qtype", PACKED_QTYPES)
def test_packing_a_large_weight_on_several_threads_keeps_every_weight(qtype: str) -> None:
    """Packing splits a weight's channel groups among threads from 128 groups on (the last part shorter): 2,070
    channels (130 groups, the last padded) unpack to the definition's numbers."""
    if quant.packed_ops() is None:
        pytest.skip("no packed kernel on this CPU")
    _skip_unless_packed(qtype)
    gen = torch.Generator().manual_seed(9)
    blocks = quant._random_blocks(qtype, 2070, quant.weight_block(qtype), gen)
    packed = blocks.pack()
    assert packed.packed and torch.equal(packed.dequantize(), reference_dequantize(blocks))


def _random_q6_k(n: int, k: int, seed: int) -> tuple[QuantTensor, np.ndarray]:
    """Q6_K rows of any quants and int8 scales, with positive fp16 d, and gguf-py's dequantization of them."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // 256, 210), dtype=np.uint8)
    raw[..., 208:210] = rng.uniform(1e-4, 0.01, size=(n, k // 256, 1)).astype(np.float16).view(np.uint8)
    expected = gguf.quants.dequantize(raw.reshape(n, -1), gguf.GGMLQuantizationType.Q6_K)
    return QuantTensor("Q6_K", torch.from_numpy(raw.reshape(n, -1)), (n, k)), expected


def test_q6_k_decodes_as_gguf_py_decodes_it_and_its_packed_kernel_is_its_definition() -> None:
    """Q6_K (a Q4_K_M file's head and half its ffn_down / attn_v) is served as it is: 67 channels (a padded last
    group) by 512 inputs (2 super-blocks of 256)."""
    blocks, expected = _random_q6_k(67, 512, seed=6)
    dense = torch.from_numpy(expected).reshape(67, 512)
    assert torch.equal(reference_dequantize(blocks), dense)  # exact: d * scale * level fits a float32
    packed = _layout(blocks, "packed")
    assert torch.equal(packed.dequantize(), dense)
    ids = torch.tensor([0, 66, 3, 3])
    assert torch.equal(quant.embedding(ids, packed), dense[ids])
    assert torch.equal(quant.embedding(ids, blocks), dense[ids])  # an untied embedding keeps the rows
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(13, 512, generator=gen)
    got = quant.linear(x, packed)
    torch.testing.assert_close(got, quant.reference_linear(x, blocks), rtol=1e-5, atol=1e-4)
    exact = x @ dense.T
    assert float((got - exact).norm() / exact.norm()) < 0.01
    alone = torch.cat([quant.linear(x[i : i + 1], packed) for i in range(13)])
    assert torch.equal(got, alone)


def test_q4_k_is_served_as_it_is_by_the_packed_kernel() -> None:
    """Q4_K (most of a Q4_K_M file), packed with its 6-bit scales as bytes: gguf-py's dequantization exactly, and
    the kernel is Q4_1's arithmetic with each sub-block's d * scale and dmin * min."""
    rng = np.random.default_rng(8)
    n, k = 67, 512
    raw = rng.integers(0, 256, size=(n, k // 256, 144), dtype=np.uint8)
    for at in (0, 2):  # d and dmin: positive fp16, as llama-quantize writes them
        raw[..., at : at + 2] = rng.uniform(1e-4, 0.02, size=(n, k // 256, 1)).astype(np.float16).view(np.uint8)
    dense = torch.from_numpy(gguf.quants.dequantize(raw.reshape(n, -1), gguf.GGMLQuantizationType.Q4_K))
    blocks = QuantTensor("Q4_K", torch.from_numpy(raw.reshape(n, -1)), (n, k))
    assert torch.equal(reference_dequantize(blocks), dense)
    if quant.packed_ops() is None:
        pytest.skip("no packed kernel on this CPU")
    packed = _layout(blocks, "packed")
    assert packed.nbytes == 5 * 16 * 2 * 144  # ggml's 144 bytes a super-block: nothing widened
    assert torch.equal(packed.dequantize(), dense)
    assert torch.equal(quant.embedding(torch.tensor([66, 0]), packed), dense[[66, 0]])
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(quant.linear(x, packed), quant.reference_linear(x, blocks), rtol=1e-5, atol=1e-4)


@torch.inference_mode()
def test_a_merged_projection_of_mixed_block_types_keeps_each_part_in_its_own() -> None:
    """A Q4_K_M file's q/k (Q4_K) and v (Q6_K) merge into one qkv projection: with the packed kernel each run of one
    type stays as it is (QuantParts), computed by its own kernel; its output is the parts' outputs side by side."""
    from radixserve.runtime.models.linear import Linear
    from radixserve.runtime.models.loading import _assemble

    if quant.packed_ops() is None:
        pytest.skip("no packed kernel on this CPU: mixed parts are re-quantized to Q8_0")
    gen = torch.Generator().manual_seed(10)
    q, k = (quant._random_blocks("Q4_K", n, 256, gen) for n in (64, 32))
    v = quant._random_blocks("Q6_K", 32, 256, gen)
    merged = _assemble([q, k, v])
    assert isinstance(merged, quant.QuantParts) and [p.qtype for p in merged.parts] == ["Q4_K", "Q6_K"]
    assert merged.shape == (128, 256) and merged.parts[0].shape == (96, 256)  # q and k joined: one run
    layer = Linear(256, 128, bias=True)
    layer.bias = torch.nn.Parameter(torch.randn(128, generator=gen), requires_grad=False)
    layer.set_quantized(merged)
    assert layer.qpacked and isinstance(layer.quant, quant.QuantParts)
    dense = torch.cat([reference_dequantize(t) for t in (q, k, v)])
    x = torch.randn(5, 256, generator=gen)
    want = torch.cat([quant.reference_linear(x, t) for t in (q, k, v)], dim=-1) + layer.bias
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-4)
    assert float((layer(x) - (x @ dense.T + layer.bias)).norm() / want.norm()) < 0.01
    assert torch.equal(layer.quant.dequantize(), dense)


@pytest.mark.parametrize("qtype", PACKED_QTYPES)
def test_a_merged_projection_of_one_block_type_is_packed_part_by_part(qtype: str) -> None:
    """gate/up (or q/k) of one block type are packed straight from the file's bytes, each part into its own channel
    groups: the same bytes as packing their concatenation. A part other than the last whose rows are not a
    multiple of 16 would share a group with the next: those are concatenated first, as before."""
    from radixserve.runtime.models.loading import _assemble

    if quant.packed_ops() is None:
        pytest.skip("no packed kernel on this CPU")
    _skip_unless_packed(qtype)
    gen = torch.Generator().manual_seed(11)
    k = quant.weight_block(qtype) * 2
    gate, up = quant._random_blocks(qtype, 48, k, gen), quant._random_blocks(qtype, 37, k, gen)
    whole = QuantTensor(qtype, torch.cat([gate.data, up.data]), (85, k))
    merged = _assemble([gate, up], pack=True)
    assert isinstance(merged, QuantTensor) and merged.packed and merged.shape == (85, k)
    assert torch.equal(merged.data, whole.pack().data)
    assert torch.equal(merged.dequantize(), reference_dequantize(whole))
    odd = quant._random_blocks(qtype, 40, k, gen)
    apart = _assemble([odd, up], pack=True)
    assert isinstance(apart, QuantTensor) and not apart.packed and apart.shape == (77, k)
    assert not _assemble([gate, up]).packed  # without pack (a weight bound for another device): the rows


def test_a_weight_viewing_the_file_map_is_copied_by_whoever_keeps_it_as_it_is() -> None:
    """The GGUF loader hands out views of the file's map (``mapped``): a linear layer's packing copies them, an
    embedding (which keeps its blocks as given) copies them itself, so no layer holds the map after loading."""
    from radixserve.runtime.models.linear import Embedding, Linear

    gen = torch.Generator().manual_seed(12)
    blocks = quant._random_blocks("Q8_0", 48, 64, gen)
    mapped = QuantTensor("Q8_0", blocks.data, blocks.shape, mapped=True)
    assert mapped.rows(slice(0, 16)).mapped and not mapped.rows(torch.arange(16)).mapped
    embedding = Embedding(48, 64)
    embedding.set_quantized(mapped)
    layer = Linear(64, 48, bias=False)
    layer.set_quantized(mapped)
    for module in (embedding, layer):
        assert module.qdata.untyped_storage().data_ptr() != blocks.data.untyped_storage().data_ptr()
        assert not module.quant.mapped
    assert torch.equal(embedding.quant.dequantize(), reference_dequantize(blocks))
    assert torch.equal(layer.quant.dequantize(), reference_dequantize(blocks))


def test_the_packed_kernel_is_used_where_the_cpu_has_avx512_vnni_or_avx2() -> None:
    assert (quant.packed_ops() is not None) == _has_packed_kernel()
    w = quantize_q4_1(torch.randn(32, 64))
    assert w.pack().packed == _has_packed_kernel()
    if _has_packed_kernel():
        with pytest.raises(ValueError, match="slice it before packing"):
            w.pack().rows(slice(0, 16))


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_the_avx2_kernel_rounds_k_quant_activations_per_super_block(qtype: str) -> None:
    """On AVX2 (no AVX-512 VNNI) the K-quants' activations are rounded with one scale per 256 inputs, as llama.cpp's
    Q8_K rounds them; the kernel computes that definition, not the per-32 one (a row whose blocks differ in
    magnitude by 100x tells them apart). The 32-weight types, and AVX-512, keep a scale per 32."""
    from radixserve.runtime.cpu_features import cpu_flags

    if quant.packed_ops() is None:
        pytest.skip("no packed kernel on this CPU")
    _skip_unless_packed(qtype)
    avx512 = {"avx512f", "avx512bw", "avx512_vnni"} <= cpu_flags()
    assert quant.activation_block(qtype) == (32 if avx512 else 256)
    assert {quant.activation_block(t) for t in QTYPES} == {32}
    gen = torch.Generator().manual_seed(13)
    blocks = quant._random_blocks(qtype, 40, 512, gen)
    x = torch.randn(3, 512, generator=gen) * torch.tensor([100.0, 1.0]).repeat_interleave(32).repeat(8)
    got = quant.linear(x, blocks.pack())
    for act in (32, 256):
        want = quant.reference_linear(x, blocks, act_block=act)
        close = torch.allclose(got, want, rtol=1e-4, atol=1e-3)
        assert close == (act == quant.activation_block(qtype)), act


@pytest.mark.parametrize("slice_bytes", [quant.UNPACK_SLICE_BYTES, 4096])
@pytest.mark.parametrize("layout", ["rows", "packed"])
@torch.inference_mode()
def test_a_bfloat16_prefill_step_unpacks_the_blocks_for_the_gemm(
    slice_bytes: int, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From BF16_UNPACK_FROM_ROWS rows a bfloat16 product unpacks the blocks (slice by slice of output channels
    when the slice is smaller than the matrix) and is the dequantized matmul to bfloat16 rounding, bias included;
    fewer rows keep the block kernel."""
    monkeypatch.setattr(quant, "UNPACK_SLICE_BYTES", slice_bytes)
    monkeypatch.setattr(quant, "amx", lambda: True)  # without AMX a packed weight keeps its kernel (tested below)
    gen = torch.Generator().manual_seed(3)
    w = quantize_q4_1(torch.randn(200, 128, generator=gen))
    want_w = reference_dequantize(w)
    w = _layout(w, layout)
    bias = torch.randn(200, generator=gen).to(torch.bfloat16)
    for rows in (quant.BF16_UNPACK_FROM_ROWS - 1, quant.BF16_UNPACK_FROM_ROWS, 300):
        x = torch.randn(rows, 128, generator=gen).to(torch.bfloat16)
        want = torch.nn.functional.linear(x.float(), want_w, bias.float())
        got = quant.linear(x, w, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 200)
        assert (got.float() - want).norm() / want.norm() < 1e-2


@pytest.mark.parametrize("amx", [False, True])
@torch.inference_mode()
def test_without_amx_a_packed_weight_keeps_its_kernel_at_every_row_count(
    amx: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the bfloat16 GEMM has no AMX the int8 kernel is the faster one at prefill sizes too, and a row's
    result then stays independent of its batch in bfloat16 as well."""
    monkeypatch.setattr(quant, "amx", lambda: amx)
    gen = torch.Generator().manual_seed(5)
    w = _layout(quantize_q4_1(torch.randn(48, 64, generator=gen)), "packed")
    x = torch.randn(quant.BF16_UNPACK_FROM_ROWS + 6, 64, generator=gen).to(torch.bfloat16)
    alone = torch.cat([quant.linear(x[i : i + 1], w) for i in range(x.shape[0])])
    assert torch.equal(quant.linear(x, w), alone) != amx


def test_the_compiled_kernels_build_and_pass_their_check() -> None:
    """The kernels are what makes quantized serving fast: on this machine they must build (a C++ compiler is
    part of the set-up) and agree with the PyTorch definition."""
    assert quant.quant_ops() is not None


@pytest.mark.parametrize(("quantize", "levels"), [(quantize_q8_0, 127), (quantize_q4_1, 15)])
def test_our_quantizers_round_trip_within_half_a_step(quantize, levels: int) -> None:
    torch.manual_seed(0)
    w = torch.randn(64, 256) * torch.linspace(0.01, 3, 256)  # blocks of very different ranges
    back = quantize(w).dequantize()
    blocks, back_blocks = w.reshape(64, 8, 32), back.reshape(64, 8, 32)
    span = blocks.amax(-1) - blocks.amin(-1) if levels == 15 else 2 * blocks.abs().amax(-1)
    step = span / levels if levels == 15 else blocks.abs().amax(-1) / levels
    err = (blocks - back_blocks).abs().amax(-1)
    # Half a step of rounding, plus what the fp16 storage of the scale (and of Q4_1's minimum) can add at most.
    fp16 = 2.0**-11
    bound = step * (0.5 + levels * fp16) + blocks.amin(-1).abs() * fp16 + 1e-7
    assert bool((err <= bound).all()), float((err / step).max())
    mean_err = ((blocks - back_blocks).abs() / step[..., None]).mean()
    assert float(mean_err) < 0.3  # a quarter of a step on average: the rounding, unbiased


def test_quantizing_a_checkpoint_at_load(tiny_model_dir: Path) -> None:
    prompt = [[3, 17, 42, 99, 7, 8, 120]]
    logits = {}
    for mode in ("none", "int8", "int4"):
        engine = Engine(model=str(tiny_model_dir), device="cpu", max_total_tokens=1024, quantization=mode)
        try:
            model = engine.core.runner.model
            qtypes = {m.qtype for m in model.modules() if getattr(m, "qtype", None) is not None}
            assert qtypes == ({"int8": {"Q8_0"}, "int4": {"Q4_1"}}.get(mode) or set())
            with torch.inference_mode():
                hidden = model.model.embed_tokens(torch.tensor(prompt[0]))
                logits[mode] = model.compute_logits(hidden).float()
        finally:
            engine.shutdown()
    for mode, tol in (("int8", 0.02), ("int4", 0.25)):
        rel = (logits[mode] - logits["none"]).norm() / logits["none"].norm()
        assert rel < tol, (mode, float(rel))


@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_a_packed_linear_layer_calls_the_kernel_as_quant_linear_does(
    amx: bool, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Linear.forward`` calls the packed kernel directly (no per-call ``QuantTensor``); its results are
    ``quant.linear``'s bit for bit, bias included, at decode and prefill sizes, with AMX's unpacking and without."""
    from radixserve.runtime.models.linear import Linear

    monkeypatch.setattr(quant, "amx", lambda: amx)
    gen = torch.Generator().manual_seed(8)
    lin = Linear(64, 40, bias=True)
    lin.bias.data = torch.randn(40, generator=gen).to(dtype)
    lin.set_quantized(quantize_q4_1(torch.randn(40, 64, generator=gen)))
    assert lin.qpacked == (quant.packed_ops() is not None)
    for rows in (1, 5, quant.BF16_UNPACK_FROM_ROWS + 3):
        x = torch.randn(rows, 64, generator=gen).to(dtype)
        assert torch.equal(lin(x), quant.linear(x, lin.quant, lin.bias))
    assert (lin._direct is not None) == lin.qpacked


@pytest.mark.parametrize("layout", ["rows", "packed"])
@torch.inference_mode()
def test_a_head_in_blocks_picks_the_dequantized_weights_own_leader(layout: str) -> None:
    """The kernel's int8 activations swap near-tied leaders; ``exact_leaders`` recomputes each row's leading
    logits from the dequantized rows, so greedy decoding follows the float32 run of the same blocks."""
    from radixserve.runtime.models.llama import HEAD_LEADERS, exact_leaders

    gen = torch.Generator().manual_seed(9)
    # A vocabulary of 3,000 random rows: among 128 rows of x a few leaders lie within the kernel's rounding of
    # the runner-up, as near-ties of a real vocabulary do.
    w = _layout(quantize_q8_0(torch.randn(3000, 96, generator=gen)), layout)
    x = torch.randn(128, 96, generator=gen)
    kernel = quant.linear(x, w)
    exact = x @ w.dequantize().T
    assert (kernel.argmax(-1) != exact.argmax(-1)).any()  # the case this is for happens here
    bias = torch.randn(3000, generator=gen)
    got = exact_leaders(kernel + bias, x, w, bias)
    assert torch.equal(got.argmax(-1), (exact + bias).argmax(-1))
    top = (kernel + bias).topk(HEAD_LEADERS, dim=-1).indices
    torch.testing.assert_close(got.gather(-1, top), (exact + bias).gather(-1, top), rtol=1e-5, atol=1e-5)
    rest = torch.ones_like(got, dtype=torch.bool).scatter(-1, top, False)
    assert torch.equal(got[rest], (kernel + bias)[rest])  # only the leaders change
