"""The compiled greedy picks (``csrc/greedy.cpp``) against their torch definitions (``runtime/greedy.py``)."""

from __future__ import annotations

import shutil

import pytest
import torch

from radixserve.runtime import greedy
from radixserve.runtime.cpu_ext import load_kernels

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to build the kernels")


@pytest.fixture(scope="module")
def ops():
    kernels = load_kernels()
    assert kernels is not None, "the CPU kernels did not build (see the log)"
    return kernels.greedy


def _rows(seed: int, dtype: torch.dtype, rows: int, columns: int, ties: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, columns, generator=gen) * 3
    return (x.round() if ties else x).to(dtype)  # rounded: many equal values, the largest among them


# Row lengths around the 16-value vector steps, a vocabulary row, and padding columns past the vocabulary.
SHAPES = [(1, 1, 0), (3, 15, 1), (2, 16, 0), (5, 17, 3), (4, 1000, 24), (2, 49152, 64)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "vocab", "pad"), SHAPES)
@pytest.mark.parametrize("ties", [False, True])
def test_argmax_checked_is_torch_argmax_with_row_checks(ops, dtype, rows, vocab, pad, ties) -> None:
    x = _rows(rows * vocab + pad, dtype, rows, vocab + pad, ties)
    want = torch.cat([torch.isfinite(x).all(dim=-1).long(), x[:, :vocab].argmax(dim=-1)])
    assert torch.equal(ops.argmax_checked(x, vocab), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_checked_flags_rows_with_nan_or_inf_anywhere(ops, dtype) -> None:
    x = _rows(7, dtype, 4, 300, ties=False)
    x[0, 5] = float("nan")
    x[1, 299] = float("inf")  # a padding column: checked, never picked
    x[2, 100] = float("-inf")
    out = ops.argmax_checked(x, 290)
    assert out[:4].tolist() == [0, 0, 0, 1]
    assert ((out[4:] >= 0) & (out[4:] < 290)).all()  # every token a valid index, used or not
    assert out[7] == x[3, :290].argmax()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "columns"), [(1, 8), (3, 9), (2, 17), (5, 1000), (2, 49152)])
@pytest.mark.parametrize("ties", [False, True])
def test_top_indices_are_the_largest_in_order_lowest_index_first_among_equals(ops, dtype, rows, columns, ties) -> None:
    x = _rows(rows + columns, dtype, rows, columns, ties)
    k = 8
    got = ops.top_indices(x, k)
    assert torch.equal(x.gather(1, got), x.topk(k, dim=-1).values)  # the k largest values, largest first
    for r in range(rows):
        assert len(set(got[r].tolist())) == k
        values = x[r, got[r]].tolist()
        for j in range(k - 1):
            if values[j] == values[j + 1]:
                assert got[r, j] < got[r, j + 1]
        # Among values equal to the k-th, the lowest indices are the ones taken.
        kth = values[-1]
        taken = sorted(i for i in got[r].tolist() if x[r, i] == kth)
        equal = (x[r] == kth).nonzero().flatten().tolist()
        assert taken == equal[: len(taken)]


def test_top_indices_keeps_valid_distinct_indices_when_values_are_not_finite(ops) -> None:
    x = torch.full((2, 40), float("-inf"))
    x[1, 3] = float("nan")
    got = ops.top_indices(x, 8)
    for r in range(2):
        assert len(set(got[r].tolist())) == 8 and ((got[r] >= 0) & (got[r] < 40)).all()


def test_wrappers_fall_back_to_torch_where_the_kernels_do_not_apply() -> None:
    x = _rows(3, torch.float16, 3, 50, ties=False)  # float16: no kernel
    assert torch.equal(greedy.argmax_checked(x, 40), torch.cat([torch.ones(3, dtype=torch.long), x[:, :40].argmax(-1)]))
    assert torch.equal(greedy.top_indices(x, 5), x.topk(5, dim=-1).indices)
    strided = _rows(4, torch.float32, 3, 50, ties=False)[:, ::2]  # rows not contiguous: torch
    assert torch.equal(greedy.top_indices(strided, 5), strided.topk(5, dim=-1).indices)


def test_the_kernels_refuse_what_they_cannot_read(ops) -> None:
    x = torch.randn(2, 10)
    with pytest.raises(RuntimeError, match="0 < n <= columns"):
        ops.argmax_checked(x, 11)
    with pytest.raises(RuntimeError, match="0 < k"):
        ops.top_indices(x, 11)
    with pytest.raises(RuntimeError, match="rows contiguous"):
        ops.top_indices(x.t(), 2)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.argmax_checked(x.half(), 5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("columns", [1, 16, 33, 2048])
def test_finite_rows_flags_each_row_with_a_nan_or_an_infinity(ops, dtype, columns) -> None:
    x = _rows(columns, dtype, 5, columns, ties=False)
    x[1, columns - 1] = float("nan")  # the last column: past the last whole vector when columns % 16 != 0
    x[2, 0] = float("inf")
    x[3, columns // 2] = float("-inf")
    x[4, 0] = 3e38  # finite, however large
    want = torch.isfinite(x).all(dim=-1).long()
    assert want.tolist() == [1, 0, 0, 0, 1]
    assert torch.equal(ops.finite_rows(x), want)
    assert torch.equal(greedy.finite_rows(x), want)


def _packed_head(seed: int, n: int, k: int):  # noqa: ANN202 - a packed Q8_0 QuantTensor, or a skip
    from radixserve.runtime.models import quant

    if quant.packed_ops() is None:
        pytest.skip("no packed kernel on this CPU")
    gen = torch.Generator().manual_seed(seed)
    return quant.quantize_q8_0(torch.randn(n, k, generator=gen)).pack(), gen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@torch.inference_mode()
def test_compiled_exact_leaders_are_the_float64_products_of_the_leading_rows(ops, dtype, with_bias) -> None:
    """The compiled exact_leaders (the packed head's path of ``llama.exact_leaders``) against its torch
    definition: each row's 8 largest logits replaced by float64 sums rounded once, everything else untouched."""
    from radixserve.runtime.models import quant
    from radixserve.runtime.models.llama import HEAD_LEADERS, exact_leaders

    w, gen = _packed_head(11, 500, 96)
    x = torch.randn(6, 96, generator=gen).to(dtype)
    bias = torch.randn(500, generator=gen).to(dtype) if with_bias else None
    logits = quant.linear(x, w, bias)
    top = logits.float().topk(HEAD_LEADERS, dim=-1).indices
    exact = (quant.embedding(top, w).double() * x.double().unsqueeze(1)).sum(-1)
    if bias is not None:
        exact = exact + bias.double()[top]
    want = logits.clone().scatter_(-1, top, exact.to(dtype))
    got = exact_leaders(logits.clone(), x, w, bias)
    assert torch.equal(got, want)
    picked = ops.exact_argmax_checked(logits.clone(), x, w.data, quant.QTYPES["Q8_0"], 96, 500, HEAD_LEADERS, bias, 490)
    assert torch.equal(picked, greedy.argmax_checked(want, 490))


@torch.inference_mode()
def test_a_models_greedy_tokens_are_the_argmax_of_its_logits(tiny_model_dir) -> None:
    """``greedy_tokens`` (the runner's greedy fast path) against ``argmax_checked(compute_logits(...))``: plain
    weights, a packed head (the compiled tail) and a head whose blocks keep their rows (torch)."""
    from radixserve.runtime.models import LlamaForCausalLM, ModelArgs, quant
    from radixserve.runtime.weights import load_hf_config

    args = ModelArgs.from_hf_config(load_hf_config(tiny_model_dir))
    model = LlamaForCausalLM(args)
    vocab, k = args.vocab_size, args.hidden_size
    gen = torch.Generator().manual_seed(5)
    heads = [None, quant.quantize_q8_0(torch.randn(vocab, k, generator=gen))]
    if quant.packed_ops() is not None:
        heads.append(heads[1].pack())
    for head in heads:
        if head is not None:
            model.lm_head.set_quantized(head)
        hidden = torch.randn(5, k, generator=gen)
        want = greedy.argmax_checked(model.compute_logits(hidden), vocab - 3)
        assert torch.equal(model.greedy_tokens(hidden, vocab - 3), want)
