"""Our model code against HuggingFace's on the same weights: full prefill, chunked prefill and decode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from radixserve.runtime.attention import AttentionMetadata, ExtendSeq, ForwardContext, TorchReferenceBackend
from radixserve.runtime.kv_pool import KVPool
from radixserve.runtime.models import LlamaForCausalLM, ModelArgs
from radixserve.runtime.models.linear import plain_bf16_weights
from radixserve.runtime.weights import iter_weights, load_hf_config


def _load(folder: Path) -> LlamaForCausalLM:
    args = ModelArgs.from_hf_config(load_hf_config(folder))
    model = LlamaForCausalLM(args)
    model.load_weights(iter_weights(folder, progress=False))
    return model.eval()


def _ctx(
    pool: KVPool,
    out_slots: list[int],
    extends: list[ExtendSeq],
    decode: list[list[int]] | None = None,
    cpu_kernels: bool = False,
):
    decode_slots = decode_mask = None
    if decode:
        width = max(len(t) for t in decode)
        decode_slots = torch.tensor([t + [t[0]] * (width - len(t)) for t in decode])
        lens = torch.tensor([len(t) for t in decode])
        decode_mask = (torch.arange(width)[None, :] < lens[:, None])[:, None, None, :]
    meta = AttentionMetadata(
        out_slots=torch.tensor(out_slots),
        num_decode=len(decode or []),
        decode_slots=decode_slots,
        decode_mask=decode_mask,
        extends=tuple(extends),
    )
    return ForwardContext(meta, pool, TorchReferenceBackend(cpu_kernels=cpu_kernels))


@torch.inference_mode()
def assert_logits_match_hf(folder: Path) -> LlamaForCausalLM:
    """Our model's final logits within 1e-4 of HF's on a 23-token prompt: computed whole, then in two chunks into
    scattered slots with the last token as a decode (on the PyTorch path and the compiled kernel)."""
    ours = _load(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    args = ours.args
    torch.manual_seed(0)
    ids = torch.randint(0, args.vocab_size, (23,))
    ref = hf(ids[None]).logits[0]

    pool = KVPool(64, args.num_layers, args.num_kv_heads, args.head_dim, torch.float32, torch.device("cpu"))
    # Whole prompt at once, into slots 0..22.
    n = len(ids)
    h = ours(ids, torch.arange(n), _ctx(pool, list(range(n)), [ExtendSeq(0, n, n, None)]))
    torch.testing.assert_close(ours.compute_logits(h), ref, atol=1e-4, rtol=1e-4)

    # Same prompt in two chunks into scattered slots, then the last token as a decode.
    slots = list(range(63, 63 - n, -1))
    h1 = ours(ids[:10], torch.arange(10), _ctx(pool, slots[:10], [ExtendSeq(0, 10, 10, None)]))
    kv = torch.tensor(slots[:22])
    h2 = ours(ids[10:22], torch.arange(10, 22), _ctx(pool, slots[10:22], [ExtendSeq(0, 12, 22, kv)]))
    for kernels in (False, True):
        h3 = ours(ids[22:], torch.arange(22, 23), _ctx(pool, slots[22:], [], decode=[slots], cpu_kernels=kernels))
        got = ours.compute_logits(torch.cat([h1, h2, h3]))
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    return ours


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_qwen_dir"])
def test_prefill_chunked_and_decode_match_hf(fixture: str, request: pytest.FixtureRequest) -> None:
    assert_logits_match_hf(request.getfixturevalue(fixture))


@torch.inference_mode()
def test_the_rows_a_step_reads_get_the_last_layer_for_them_alone(tiny_model_dir: Path) -> None:
    """``ForwardContext.out_rows``: the model returns those rows' final hidden states (the last layer's MLP runs for
    them only), which give HF's logits at those positions; every row's keys and values still go into the pool (a
    decode after the step reads them)."""
    ours = _load(tiny_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    args = ours.args
    torch.manual_seed(1)
    a, b = torch.randint(0, args.vocab_size, (17,)), torch.randint(0, args.vocab_size, (9,))
    pool = KVPool(64, args.num_layers, args.num_kv_heads, args.head_dim, torch.float32, torch.device("cpu"))
    ids, positions = torch.cat([a, b[:8]]), torch.cat([torch.arange(17), torch.arange(8)])
    ctx = _ctx(pool, list(range(25)), [ExtendSeq(0, 17, 17, None), ExtendSeq(17, 8, 8, None)])
    keep = torch.tensor([16, *range(17, 25)])  # the first prompt's last row, every row of the second
    ctx.out_rows = keep
    hidden = ours(ids, positions, ctx)
    assert hidden.shape[0] == len(keep)
    ref_a, ref_b = hf(a[None]).logits[0], hf(b[None]).logits[0]
    got = ours.compute_logits(hidden)
    torch.testing.assert_close(got[0], ref_a[16], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1:], ref_b[:8], atol=1e-4, rtol=1e-4)
    # The second prompt's last token as a decode reads the keys and values the trimmed step stored.
    h = ours(b[8:], torch.tensor([8]), _ctx(pool, [25], [], decode=[[*range(17, 25), 25]]))
    torch.testing.assert_close(ours.compute_logits(h)[0], ref_b[8], atol=1e-4, rtol=1e-4)


# (dtype, compiled CPU kernel, head size): the kernel has an AVX-512 path for head sizes 64 and 128 and a
# generic one for the rest, in float32 and bfloat16.
DECODE_CASES = [
    (torch.float32, False, 16),
    (torch.bfloat16, False, 16),
    (torch.float32, True, 16),
    (torch.float32, True, 64),
    (torch.bfloat16, True, 16),
    (torch.bfloat16, True, 64),
]


@pytest.mark.parametrize(("dtype", "cpu_kernels", "d"), DECODE_CASES)
@torch.inference_mode()
def test_shared_prefix_decode_attention_equals_plain(dtype: torch.dtype, cpu_kernels: bool, d: int) -> None:
    """Cascade decode attention (shared prefix once, merged by log-sum-exp) equals attention over full rows."""
    from radixserve.runtime.attention import PrefixGroup

    torch.manual_seed(0)
    n_kv, heads = 2, 6
    pool = KVPool(400, 1, n_kv, d, dtype, torch.device("cpu"))
    pool.k[0].copy_(torch.randn(400, n_kv, d))
    pool.v[0].copy_(torch.randn(400, n_kv, d))
    prefix = list(range(100, 180))
    rows = [prefix + list(range(200 + 10 * i, 200 + 10 * i + 1 + i)) for i in range(4)]
    rows.append(list(range(300, 350)))  # not in the group
    q = torch.randn(len(rows), heads, d, dtype=dtype)

    def pad(tables: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(t) for t in tables)
        slots = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables])
        lens = torch.tensor([len(t) for t in tables])
        return slots, (torch.arange(width)[None, :] < lens[:, None])[:, None, None, :]

    backend = TorchReferenceBackend(cpu_kernels=cpu_kernels)
    assert not cpu_kernels or backend._decode_kernel is not None, "the CPU kernel did not build"
    outs = []
    for grouped in (False, True):
        tables = [r[len(prefix):] if grouped and i < 4 else r for i, r in enumerate(rows)]
        groups = (PrefixGroup(torch.arange(4), torch.tensor(prefix)),) if grouped else ()
        slots, mask = pad(tables)
        meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), len(rows), slots, mask, (), groups)
        # Write nothing new: out_slots is empty, k/v for this step are empty tensors.
        empty = torch.zeros(0, n_kv, d, dtype=dtype)
        outs.append(backend.forward(0, q, empty, empty, meta, pool))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)


@pytest.mark.parametrize(("dtype", "cpu_kernels", "d"), DECODE_CASES)
@torch.inference_mode()
def test_batched_decode_attention_equals_per_row_softmax(dtype: torch.dtype, cpu_kernels: bool, d: int) -> None:
    """The decode path (one gather of keys, embedding_bag over values, padding masked; or the compiled kernel)
    equals plain attention of each row over its own slots, with grouped-query heads; new K/V land in their slots
    first."""
    torch.manual_seed(0)
    n_kv, heads, n_slots = 2, 6, 300
    pool = KVPool(n_slots, 2, n_kv, d, dtype, torch.device("cpu"))
    pool.k[1].copy_(torch.randn(n_slots, n_kv, d))
    pool.v[1].copy_(torch.randn(n_slots, n_kv, d))
    perm = torch.randperm(n_slots).tolist()
    tables = [perm[:40], perm[40:41], perm[41:141], perm[141:158]]  # ragged rows: padding to 100
    q = torch.randn(len(tables), heads, d, dtype=dtype)
    k_new = torch.randn(len(tables), n_kv, d, dtype=dtype)
    v_new = torch.randn(len(tables), n_kv, d, dtype=dtype)
    out_slots = [t[-1] for t in tables]
    got = _ctx(pool, out_slots, [], decode=tables, cpu_kernels=cpu_kernels).attend(1, q, k_new, v_new)
    assert torch.equal(pool.k[1][torch.tensor(out_slots)], k_new)
    for i, table in enumerate(tables):
        keys = pool.k[1][torch.tensor(table)].float().repeat_interleave(heads // n_kv, dim=1)  # [L, H, D]
        values = pool.v[1][torch.tensor(table)].float().repeat_interleave(heads // n_kv, dim=1)
        probs = torch.softmax(torch.einsum("hd,lhd->hl", q[i].float(), keys) * d**-0.5, dim=-1)
        want = torch.einsum("hl,lhd->hd", probs, values)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got[i].float(), want, atol=tol, rtol=tol)


def test_merged_projections_load_hf_tensors_into_their_rows(tiny_model_dir: Path) -> None:
    model = _load(tiny_model_dir)
    weights = dict(iter_weights(tiny_model_dir, progress=False))
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    parts = [
        ("self_attn", attn.qkv_proj, ("q_proj", "k_proj", "v_proj")),
        ("mlp", mlp.gate_up_proj, ("gate_proj", "up_proj")),
    ]
    for owner, merged, names in parts:
        for name in names:
            want = weights[f"model.layers.1.{owner}.{name}.weight"]
            assert torch.equal(merged.weight[merged.part_rows(name)], want)
    args = model.args
    incomplete = {k: v for k, v in weights.items() if k != "model.layers.0.self_attn.k_proj.weight"}
    with pytest.raises(ValueError, match="lacks 1 tensors"):
        LlamaForCausalLM(args).load_weights(incomplete.items())
    with pytest.raises(ValueError, match="checkpoint shape"):
        bad = dict(weights, **{"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)})
        LlamaForCausalLM(args).load_weights(bad.items())


def test_onednn_linear_matches_f_linear_and_follows_weight_changes() -> None:
    from radixserve.runtime.models.linear import Linear

    torch.manual_seed(0)
    layer = Linear(64, 48, bias=True)  # uninitialized: our layers always load their weights
    with torch.no_grad():
        layer.weight.copy_(torch.randn(48, 64))
        layer.bias.copy_(torch.randn(48))

    def check(x: torch.Tensor) -> None:
        with torch.inference_mode():
            torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))

    for rows in (1, 8, 100):
        check(torch.randn(rows, 64))
    with torch.no_grad():
        layer.weight.mul_(2)  # in place, as loading does
    check(torch.randn(8, 64))
    layer.weight = torch.nn.Parameter(torch.randn(48, 64))  # replaced, as tensor-parallel sharding does
    check(torch.randn(8, 64))


PAIRS_DO_NOT_SERVE = "bfloat16 weights pack for oneDNN (with AMX, where measured faster) or need AVX-512 BF16"


def test_bfloat16_linear_takes_onednn_only_with_native_bf16_and_matches_f_linear() -> None:
    from radixserve.runtime.cpu_features import native_bf16
    from radixserve.runtime.models import bf16_layout
    from radixserve.runtime.models.bf16_kernels import weight_kernel
    from radixserve.runtime.models.linear import Linear, onednn_usable

    torch.manual_seed(0)
    layer = Linear(576, 1536, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(1536, 576))
    with torch.inference_mode():
        packed = layer.pack()
        assert (packed is not None) == (bool(native_bf16()) and onednn_usable(torch.bfloat16))
        # Where the pairs serve (always without AMX; with it, as measured) the weight stays plain until released
        # (the kernel, then F.linear); else oneDNN packs it.
        assert not (plain_bf16_weights() and packed is not None)
        assert plain_bf16_weights() == ("avx512_bf16" in native_bf16() and bf16_layout.chosen().pairs)
        assert (weight_kernel((layer.weight,)) is not None) == ("avx512_bf16" in native_bf16())
        for rows in (1, 3, 8, 300):
            x = torch.randn(rows, 576).to(torch.bfloat16)
            want = torch.nn.functional.linear(x.float(), layer.weight.float())
            got = layer(x)
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_bfloat16_linear_in_parts_matches_f_linear_at_every_tile_shape() -> None:
    """A merged weight served in parts (q/k/v mapped from a file apart from one another) gives F.linear's result
    over the parts' rows in order, with its bias, at every row count: the kernel's 6x4, 4x4, 2x8 and 1x16 tiles
    and their mixes up to its limit, and F.linear's per-part products above it."""
    from radixserve.runtime.models.linear import Linear, bf16_kernel_max_rows

    gen = torch.Generator().manual_seed(1)
    sizes = (64, 32, 48)
    parts = [torch.randn(n, 96, generator=gen).to(torch.bfloat16) for n in sizes]
    bias = torch.randn(sum(sizes), generator=gen).to(torch.bfloat16)
    layer = Linear(96, sum(sizes), bias=True).to(torch.bfloat16)
    with torch.no_grad():
        layer.bias.copy_(bias)
    layer.set_plain_parts(parts)
    assert layer.weight.device.type == "meta" and tuple(layer.weight.shape) == (sum(sizes), 96)
    whole = torch.cat(parts).float()
    with torch.inference_mode():
        for rows in (*range(1, 16), 17, 31, bf16_kernel_max_rows(), bf16_kernel_max_rows() + 1, 70):
            x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
            want = torch.nn.functional.linear(x.float(), whole, bias.float())
            got = layer(x)
            assert got.shape == (rows, sum(sizes)) and got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=1e-2 * want.abs().max().item(), msg=str(rows))
    with pytest.raises(ValueError, match="parts make"):
        layer.set_plain_parts(parts[:2])


@pytest.mark.skipif(not plain_bf16_weights(), reason=PAIRS_DO_NOT_SERVE)
@pytest.mark.parametrize("k", [1024, 2112])
def test_bfloat16_weights_released_into_pairs_match_f_linear_at_every_tile_shape(k: int) -> None:
    """Where bfloat16 weights are served without oneDNN (AVX-512 BF16, no AMX), releasing the plain weight packs it
    in pairs of K (``csrc/bf16_packed.cpp``): the layout is the weight's rows in blocks of 16, pair p of each row
    side by side; a weight in parts packs its parts' blocks in order. The product, with its bias, is F.linear's at
    every row count: runs of 6, 4 and 1 blocks (11 blocks, on one thread or two), tiles of 4, 6, 2 and 1 rows,
    prefetching (4-64 rows), K in slices of 2,048 above 64 rows (2,112: a slice and a ragged one) and rows in several
    chunks (2,112: 496 a chunk); the packed_ops self-check covers runs of 2."""
    from radixserve.runtime.models.bf16_kernels import packed_ops
    from radixserve.runtime.models.linear import Linear

    ops = packed_ops()
    assert ops is not None, "the packed bfloat16 kernel did not build"
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(48, 64, generator=gen).to(torch.bfloat16)
    want = w.view(3, 16, 32, 2).permute(0, 2, 1, 3).reshape(3, 16 * 64)
    for threads in (1, 2, 5):
        assert torch.equal(ops.pack([w[:32].contiguous(), w[32:].contiguous()], threads), want)

    sizes = (64, 32, 80)  # 4 + 2 + 5 blocks: runs of 6, 4 and 1 on one thread (6 | 4, 1 on two)
    parts = [torch.randn(n, k, generator=gen).to(torch.bfloat16) for n in sizes]
    bias = torch.randn(sum(sizes), generator=gen).to(torch.bfloat16)
    layer = Linear(k, sum(sizes), bias=True).to(torch.bfloat16)
    with torch.no_grad():
        layer.bias.copy_(bias)
    layer.set_plain_parts(parts)
    with torch.inference_mode():
        assert layer.release_plain()
    assert layer._bf16_packed
    assert layer.weight.device.type == "meta" and not layer._plain_parts and not list(layer.buffers())
    whole = torch.cat(parts).float()
    with torch.inference_mode():
        for rows in (*range(1, 14), 16, 31, 64, 65, 300, 1000):
            x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
            want = torch.nn.functional.linear(x.float(), whole, bias.float())
            got = layer(x)
            assert got.shape == (rows, sum(sizes)) and got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=1e-2 * want.abs().max().item(), msg=str(rows))
        x3 = torch.randn(2, 3, k, generator=gen).to(torch.bfloat16)
        torch.testing.assert_close(layer(x3), layer(x3.view(6, k)).view(2, 3, -1))


@pytest.mark.skipif(not plain_bf16_weights(), reason=PAIRS_DO_NOT_SERVE)
@pytest.mark.parametrize(("k", "width"), [(576, 1536), (2112, 80), (64, 112)])
def test_a_packed_gate_up_projection_multiplies_gated_with_the_bits_of_silu_mul_over_its_output(
    k: int, width: int
) -> None:
    """An MLP's [gate; up] projection packed in pairs of K multiplies gated (``MergedLinear.silu_mul``: one kernel,
    gate blocks with their up blocks): the result is ``fused.silu_mul`` over the layer's own output, to the bit, at
    every row count (gated runs of 3, 2 and 1 gate blocks: 80 = 5 blocks, 112 = 7; K in slices above 64 rows:
    2,112), with a bias, in 3-D; a projection that does not pack keeps the separate SiLU-and-mul."""
    from radixserve.runtime.models import fused
    from radixserve.runtime.models.llama import MergedLinear

    gen = torch.Generator().manual_seed(3)
    parts = [torch.randn(width, k, generator=gen).to(torch.bfloat16) for _ in range(2)]
    layer = MergedLinear(k, {"gate_proj": width, "up_proj": width}, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        layer.bias.copy_(torch.randn(2 * width, generator=gen).to(torch.bfloat16))
    layer.set_plain_parts(parts)
    with torch.inference_mode():
        assert layer.release_plain() and layer.gated
        for rows in (1, 2, 3, 5, 13, 16, 64, 65, 300):
            x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
            want = fused.silu_mul(layer(x))
            assert torch.equal(layer.silu_mul(x), want), rows
        x3 = torch.randn(2, 3, k, generator=gen).to(torch.bfloat16)
        assert torch.equal(layer.silu_mul(x3), fused.silu_mul(layer(x3)))
    odd = MergedLinear(64, {"gate_proj": 24, "up_proj": 24}, bias=False).to(torch.bfloat16)  # halves of 1.5 blocks
    with torch.inference_mode():
        odd.weight.copy_(torch.randn(48, 64, generator=gen).to(torch.bfloat16))
        assert odd.release_plain() and not odd.gated
        x = torch.randn(4, 64, generator=gen).to(torch.bfloat16)
        assert torch.equal(odd.silu_mul(x), fused.silu_mul(odd(x)))


def test_rms_norm_reference_gives_the_hf_bits_and_the_fused_op_agrees() -> None:
    """The PyTorch reference of RMSNorm (F.rms_norm in float32) is bit-identical to the HF formula; the compiled
    fused op, and its residual-adding form, agree with it to float32 rounding."""
    from radixserve.runtime.models import fused

    torch.manual_seed(0)
    weight, eps = torch.randn(576), 1e-5
    assert fused._ops(torch.float32) is not None, "the fused CPU ops did not build"
    for rows, scale in ((1, 1.0), (8, 30.0), (300, 0.01)):
        x = torch.randn(rows, 576) * scale
        want = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
        assert torch.equal(fused.ref_rms_norm(x, weight, eps), want)
        torch.testing.assert_close(fused.rms_norm(x, weight, eps), want, rtol=2e-6, atol=1e-6)
        residual, delta = torch.randn(rows, 576), torch.randn(rows, 576)
        expected_residual = residual + delta
        out = fused.add_rms_norm(delta, residual, weight, eps)
        assert torch.equal(residual, expected_residual)  # the residual stream's sum is exact
        torch.testing.assert_close(out, fused.ref_rms_norm(expected_residual, weight, eps), rtol=2e-6, atol=1e-6)


def test_fused_rope_and_silu_mul_agree_with_their_references() -> None:
    from radixserve.runtime.models import fused

    torch.manual_seed(1)
    qkv = torch.randn(7, (9 + 3 + 3) * 64)
    cos, sin = torch.randn(7, 1, 64), torch.randn(7, 1, 64)
    qk = qkv[:, : 12 * 64].view(7, 12, 64)
    want = fused.ref_rope(qk.clone(), cos, sin)
    v_before = qkv[:, 12 * 64 :].clone()
    fused.rope_(qk, cos, sin)
    torch.testing.assert_close(qk, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, 12 * 64 :], v_before)  # v, beside q and k in the same rows, untouched
    for width in (1536, 1539):  # 1539: a tail past the last full vector of 8 or 16
        gate_up = torch.randn(5, 2 * width) * 4
        gate_up[0, :4] = torch.tensor([-200.0, -90.0, 90.0, 200.0])  # where e^-g over- or underflows
        torch.testing.assert_close(fused.silu_mul(gate_up), fused.ref_silu_mul(gate_up), rtol=1e-5, atol=1e-6)


def test_fused_ops_in_bfloat16_round_where_pytorch_does() -> None:
    """In bfloat16 the kernels compute in float32 and round where the PyTorch definitions do: RMSNorm and the
    residual add give the reference's bits up to one bfloat16 step on a few elements (float32 sums in another order
    can round the other way), RoPE and SiLU-and-mul one rounding per result against PyTorch's one per op."""
    from radixserve.runtime.models import fused

    assert fused._ops(torch.bfloat16) is not None, "the fused CPU ops refused bfloat16"
    torch.manual_seed(2)
    bf = torch.bfloat16
    weight, eps = torch.randn(576).to(bf), 1e-5
    for rows in (1, 8, 300):
        x = (torch.randn(rows, 576) * 4).to(bf)
        got, want = fused.rms_norm(x, weight, eps), fused.ref_rms_norm(x, weight, eps)
        assert got.dtype == bf
        assert (got.float() - want.float()).abs().le(want.float().abs() * 2**-7 + 1e-6).all()
        assert (got != want).float().mean() < 0.02
        residual, delta = torch.randn(rows, 576).to(bf), torch.randn(rows, 576).to(bf)
        expected_residual = residual + delta
        out = fused.add_rms_norm(delta, residual, weight, eps)
        assert torch.equal(residual, expected_residual)  # the sum, rounded once, as PyTorch's add
        ref = fused.ref_rms_norm(expected_residual, weight, eps)
        assert (out.float() - ref.float()).abs().le(ref.float().abs() * 2**-7 + 1e-6).all()
    qkv = torch.randn(7, 15 * 64).to(bf)
    cos, sin = torch.randn(7, 1, 64).to(bf), torch.randn(7, 1, 64).to(bf)
    qk = qkv[:, : 12 * 64].view(7, 12, 64)
    exact = fused.ref_rope(qk.float(), cos.float(), sin.float())
    fused.rope_(qk, cos, sin)
    torch.testing.assert_close(qk.float(), exact, rtol=2**-8, atol=1e-6)  # one rounding of the exact result
    gate_up = (torch.randn(5, 2 * 1536) * 3).to(bf)
    gate_up[0, :4] = torch.tensor([-200.0, -90.0, 90.0, 200.0])  # where e^-g over- or underflows
    exact = fused.ref_silu_mul(gate_up.float())
    assert torch.isfinite(fused.silu_mul(gate_up)).all()
    torch.testing.assert_close(fused.silu_mul(gate_up).float(), exact, rtol=2**-8, atol=1e-5)
