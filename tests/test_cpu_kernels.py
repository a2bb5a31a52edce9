"""The compiled CPU decode-attention kernel against the same attention in plain PyTorch."""

from __future__ import annotations

import shutil

import pytest
import torch

from radixserve.runtime.attention import cpu_kernels
from radixserve.runtime.attention.cpu_kernels import decode_attention_op, reference_decode_attention

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to build the kernel")


@pytest.fixture(scope="module")
def op():
    kernel = decode_attention_op()
    assert kernel is not None, "the CPU decode-attention kernel did not build or failed its self-check (see the log)"
    return kernel


# (query heads, KV heads, head size): AVX-512 paths (64, 128; group sizes 1-8), the AVX2 one (a multiple of 8, on a
# CPU without AVX-512) and the generic one (others).
SHAPES = [(9, 3, 64), (32, 8, 128), (8, 1, 64), (7, 7, 64), (12, 4, 80), (4, 2, 16), (6, 2, 36)]


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), SHAPES)
@torch.inference_mode()
def test_kernel_equals_reference(op, heads: int, kv_heads: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(heads * dim)
    n_slots = 600
    kv = torch.randn(2, kv_heads, n_slots, dim, generator=gen) * 3
    lens = torch.tensor([1, 300, 17, 513, 64])
    # Scattered slots, padded past each length with slot 0 (padding is never read).
    slots = torch.stack([torch.randperm(n_slots, generator=gen)[:513] for _ in lens])
    for i, n in enumerate(lens.tolist()):
        slots[i, n:] = 0
    q = torch.randn(len(lens), heads, dim, generator=gen)
    out, lse = op(q, kv, slots, lens, dim**-0.5)
    want_out, want_lse = reference_decode_attention(q, kv, slots, lens, dim**-0.5)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), SHAPES)
@torch.inference_mode()
def test_kernel_in_bfloat16_reads_the_pool_in_its_dtype(op, heads: int, kv_heads: int, dim: int) -> None:
    """A bfloat16 pool and queries: float32 arithmetic over the exact bfloat16 values, one rounding of the output
    to bfloat16, lse in float32."""
    gen = torch.Generator().manual_seed(heads * dim + 1)
    kv = (torch.randn(2, kv_heads, 600, dim, generator=gen) * 3).to(torch.bfloat16)
    lens = torch.tensor([1, 300, 17, 513, 64])
    slots = torch.stack([torch.randperm(600, generator=gen)[:513] for _ in lens])
    q = torch.randn(len(lens), heads, dim, generator=gen).to(torch.bfloat16)
    out, lse = op(q, kv, slots, lens, dim**-0.5)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    want_out, want_lse = reference_decode_attention(q.float(), kv.float(), slots, lens, dim**-0.5)
    torch.testing.assert_close(out.float(), want_out, rtol=2**-8, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_rows_of_very_different_lengths_on_two_threads_equal_the_reference(op) -> None:
    """One long row and many short ones: the thread whose share holds the long row is still on it when the other
    has finished, so the other takes the rest of that share from its back (csrc/balanced.h). Every (row, head) is
    still computed once, as the reference computes it."""
    gen = torch.Generator().manual_seed(7)
    kv = torch.randn(2, 3, 12_000, 64, generator=gen)
    lens = torch.tensor([12_000] + [1 + i % 5 for i in range(63)])
    slots = torch.randperm(12_000, generator=gen).repeat(len(lens), 1)
    q = torch.randn(len(lens), 9, 64, generator=gen)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out, lse = op(q, kv, slots, lens, 0.125)
    finally:
        torch.set_num_threads(threads)
    want_out, want_lse = reference_decode_attention(q, kv, slots, lens, 0.125)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_one_slot_row_shared_by_every_query(op) -> None:
    """A prefill chunk's queries over one slot table, each seeing a prefix of it: the same numbers as a table per
    query, bit for bit; a bad slot past what any query reads is not looked at, one within it is refused."""
    gen = torch.Generator().manual_seed(7)
    kv = torch.randn(2, 3, 400, 64, generator=gen)
    table = torch.randperm(400, generator=gen)[:300]
    lens = torch.tensor([250, 251, 252, 253])
    q = torch.randn(4, 9, 64, generator=gen)
    shared = op(q, kv, table[None, :].contiguous(), lens, 0.125)
    each = op(q, kv, table[None, :].expand(4, -1).contiguous(), lens, 0.125)
    assert all(torch.equal(a, b) for a, b in zip(shared, each, strict=True))
    torch.testing.assert_close(shared[0], reference_decode_attention(q, kv, table[None, :], lens, 0.125)[0])
    padded = table.clone()
    padded[260:] = 10_000  # past the longest length: never read
    op(q, kv, padded[None, :].contiguous(), lens, 0.125)
    padded[252] = 10_000
    with pytest.raises(RuntimeError, match="slot out of range"):
        op(q, kv, padded[None, :].contiguous(), lens, 0.125)


@torch.inference_mode()
def test_kernel_handles_empty_rows_and_refuses_bad_slots(op) -> None:
    kv = torch.randn(2, 3, 50, 64)
    q = torch.randn(2, 9, 64)
    out, lse = op(q, kv, torch.zeros(2, 4, dtype=torch.long), torch.tensor([0, 4]), 0.125)
    assert torch.equal(out[0], torch.zeros(9, 64)) and torch.isinf(lse[0]).all()
    with pytest.raises(RuntimeError, match="slot out of range"):
        op(q, kv, torch.tensor([[1, 2, 50, 3], [0, 1, 2, 3]]), torch.tensor([4, 4]), 0.125)
    with pytest.raises(RuntimeError, match="length out of range"):
        op(q, kv, torch.zeros(2, 4, dtype=torch.long), torch.tensor([5, 4]), 0.125)


def test_a_build_killed_midway_does_not_block_later_starts(op) -> None:
    """torch's extension builder leaves its ``lock`` file behind when the building process is killed, and every
    later build would wait on it forever; a start finds the stale file and goes on."""
    import subprocess
    import sys
    from pathlib import Path

    from radixserve.runtime import envs
    from radixserve.runtime.cpu_ext import BUILT_MARKER, sources_key

    build_dir = envs.cache_dir() / "kernels" / sources_key()
    (build_dir / "lock").touch()  # what a process killed mid-build leaves,
    (build_dir / BUILT_MARKER).unlink(missing_ok=True)  # and it never got to mark the build finished
    code = (
        "from radixserve.runtime.attention.cpu_kernels import decode_attention_op\n"
        "assert decode_attention_op() is not None"
    )
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not (build_dir / "lock").exists()
    assert (build_dir / BUILT_MARKER).is_file()  # the next start imports the module without the builder


def test_a_finished_build_is_imported_without_the_builder() -> None:
    """torch's builder imports setuptools (~0.2 s): a start with a finished build of these sources skips it."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys\n"
        "from radixserve.runtime.cpu_ext import load_kernels\n"
        "assert load_kernels() is not None\n"
        "print('torch.utils.cpp_extension' in sys.modules)\n"
    )
    root = Path(__file__).resolve().parent.parent
    for expected in (None, "False"):  # the first run may build (and marks the build finished); the second may not
        done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        if expected is not None:
            assert done.stdout.strip().splitlines()[-1] == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_pool_stores_a_chunks_keys_and_values_as_index_copy_does(dtype: torch.dtype) -> None:
    """``KVPool.store`` on CPU writes with the compiled row copy (``fused.store_kv``): each token's k and v, views of
    the qkv projection's rows, land in its slot of every head exactly as the pair of ``index_copy_`` puts them; the
    other slots keep what they held; a slot outside the pool is refused before anything is written."""
    from radixserve.runtime.kv_pool import KVPool

    gen = torch.Generator().manual_seed(5)
    pool = KVPool(700, 2, 3, 64, dtype, torch.device("cpu"))
    assert pool._store_kv is not None
    pool.layers.copy_(torch.randn(pool.layers.shape, generator=gen).to(dtype))
    want = pool.layers.clone()
    qkv = torch.randn(300, (9 + 3 + 3) * 64, generator=gen).to(dtype)
    k, v = qkv[:, 9 * 64 : 12 * 64].view(300, 3, 64), qkv[:, 12 * 64 :].view(300, 3, 64)
    slots = torch.randperm(700, generator=gen)[:300]
    pool.store(1, slots, k, v)
    want[1, 0].index_copy_(1, slots, k.transpose(0, 1))
    want[1, 1].index_copy_(1, slots, v.transpose(0, 1))
    assert torch.equal(pool.layers, want)
    with pytest.raises(RuntimeError, match="slot out of range"):
        pool.store(0, torch.tensor([3, 700]), k[:2], v[:2])
    assert torch.equal(pool.layers, want)


# (query heads, KV heads, head size) the shared-prefix kernel takes; rows as (group, prefix length, own keys):
# prefixes within one block of keys, over several, over several runs of keys (merged), rows with none of their
# own, rows in no group, and more rows than one task holds (64 query rows).
GROUP_CASES = [
    ((9, 3, 64), [(0, 1300, 3), (0, 1300, 0), (0, 1300, 40), (-1, 0, 20), (1, 70, 1), (1, 70, 2)]),
    ((32, 8, 64), [(0, 513, 1)] * 3 + [(-1, 0, 5)]),
    ((8, 8, 128), [(3, 64, 2), (3, 64, 1), (1, 1, 1), (1, 1, 0)]),  # group ids: any below the row count
    ((12, 2, 96), [(0, 200, 7)] * 2),
    ((8, 1, 256), [(0, 129, 1)] * 4),
    ((9, 3, 64), [(0, 300, 1)] * 40),
]


@pytest.mark.parametrize(("heads", "rows"), GROUP_CASES)
@torch.inference_mode()
def test_rows_that_share_a_prefix_attend_it_together(op, heads: tuple[int, int, int], rows) -> None:  # noqa: ANN001
    """Groups (their prefix attended once, run by run, merged with each row's own keys) give the whole rows' result
    to bfloat16's rounding, and their log-sum-exp; a group whose rows disagree on its prefix length is refused."""
    n_heads, kv_heads, dim = heads
    gen = torch.Generator().manual_seed(dim + len(rows))
    kv = torch.randn(2, kv_heads, 3000, dim, generator=gen).bfloat16()
    slots, lens, groups = cpu_kernels.grouped_rows(rows, 3000, gen)
    q = torch.randn(len(rows), n_heads, dim, generator=gen).bfloat16()
    whole_out, whole_lse = op(q, kv, slots, lens, dim**-0.5)
    out, lse = op(q, kv, slots, lens, dim**-0.5, groups)
    want_out, want_lse = reference_decode_attention(q, kv, slots, lens, dim**-0.5)
    torch.testing.assert_close(out.float(), want_out.float(), rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(lse, want_lse, rtol=1e-4, atol=1e-4)
    alone = groups[:, 0] < 0  # rows in no group take the same path as without groups: the same bits
    assert torch.equal(out[alone], whole_out[alone]) and torch.equal(lse[alone], whole_lse[alone])
    if (groups[:, 0] >= 0).sum() > 1:
        bad = groups.clone()
        first = int((groups[:, 0] >= 0).nonzero()[0])
        bad[first, 1] -= 1
        with pytest.raises(RuntimeError, match="disagree on its prefix length"):
            op(q, kv, slots, lens, dim**-0.5, bad)


@torch.inference_mode()
def test_groups_the_prefix_kernel_cannot_take_are_ignored(op) -> None:
    """float32, or more than 8 query heads per KV head: the rows are whole anyway, so groups change nothing."""
    gen = torch.Generator().manual_seed(3)
    slots, lens, groups = cpu_kernels.grouped_rows([(0, 100, 2)] * 3, 400, gen)
    for dtype, (n_heads, kv_heads) in ((torch.float32, (9, 3)), (torch.bfloat16, (10, 1))):
        kv = torch.randn(2, kv_heads, 400, 64, generator=gen).to(dtype)
        q = torch.randn(3, n_heads, 64, generator=gen).to(dtype)
        plain, grouped = op(q, kv, slots, lens, 0.125), op(q, kv, slots, lens, 0.125, groups)
        assert all(torch.equal(a, b) for a, b in zip(plain, grouped, strict=True))


def test_the_shared_prefix_check_fails_a_wrong_merge(op) -> None:  # noqa: ANN001
    """The start-up check of ``prefix_groups_op`` passes the kernel and fails one whose grouped rows are off."""
    if cpu_kernels.prefix_groups_op() is None:
        pytest.skip("no AVX-512 BF16: rows are attended whole")
    assert cpu_kernels._self_check_groups(op)

    def off(*args):  # noqa: ANN002, ANN202
        out, lse = op(*args)
        if len(args) > 5:
            out = out.clone()
            out[args[5][:, 0] >= 0] *= 1.05
        return [out, lse]

    assert not cpu_kernels._self_check_groups(off)


def test_prefix_groups_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """``RADIXSERVE_PREFIX_GROUPS=0``: no grouped kernel, so the backend attends every row over its whole keys."""
    from radixserve.runtime.attention.torch_ref import TorchReferenceBackend

    monkeypatch.setenv("RADIXSERVE_PREFIX_GROUPS", "0")
    cpu_kernels.prefix_groups_op.cache_clear()
    try:
        assert cpu_kernels.prefix_groups_op() is None
        assert TorchReferenceBackend(cpu_kernels=True)._grouped_kernel is None
    finally:
        monkeypatch.delenv("RADIXSERVE_PREFIX_GROUPS")
        cpu_kernels.prefix_groups_op.cache_clear()
