"""Which layout serves bfloat16 weights (runtime/models/bf16_layout.py), and the products over weights packed in pairs
that go to oneDNN's GEMM unpacked (bf16_kernels.unpacked_product)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from radixserve.runtime.models import bf16_kernels, bf16_layout, fused

packed_ops = bf16_kernels.packed_ops
needs_pairs = pytest.mark.skipif(packed_ops() is None, reason="no AVX-512 BF16: nothing packs in pairs of K")


@pytest.fixture
def fresh_choice(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # noqa: ANN201 - a generator fixture
    """``chosen`` decided anew under the test's environment, with what is measured kept under ``tmp_path``; and
    decided again under the restored one afterwards."""
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    bf16_layout.chosen.cache_clear()
    yield
    bf16_layout.chosen.cache_clear()


def _found(pairs: bool, unpack_from_rows: int, tiles_from_rows: int = bf16_layout.NEVER) -> dict:
    """A measurement that chose the pairs or not (its figures only for the log line)."""
    decode = {"1": 1.0, "16": 2.0}
    return {
        "pairs": pairs,
        "tiles_from_rows": tiles_from_rows,
        "unpack_from_rows": unpack_from_rows,
        "chunk_ratio": 1.1,
        "served_ms": {"1": 1.0, "16": 2.0, "1024": 3.0},
        "threads": 2,
        "decode_ms": {"pairs": decode, "onednn": decode},
        "many_rows_ms": {"1024": {"pairs": 3.0, "onednn": 3.0, "unpacked": 3.0}},
    }


@pytest.mark.usefixtures("fresh_choice")
def test_with_amx_the_measured_layout_serves_and_the_environment_overrides_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """With AMX the faster layout at decode sizes serves, the pairs unpacking from the row count where oneDNN's GEMM
    measured faster; without AMX the pairs serve and nothing is measured; RADIXSERVE_BF16_LAYOUT and
    RADIXSERVE_BF16_UNPACK_FROM_ROWS (and RADIXSERVE_BF16_TILES_FROM_ROWS) override; a bad value is an error naming
    the variable."""
    found: list[dict] = []
    monkeypatch.setattr(bf16_layout, "measure", lambda: found[-1])

    def choose(flags: set[str], **env: str) -> bf16_layout.Bf16Layout:
        monkeypatch.setattr(bf16_layout, "cpu_flags", lambda: frozenset(flags))
        for name in ("BF16_LAYOUT", "BF16_UNPACK_FROM_ROWS", "BF16_TILES_FROM_ROWS"):
            monkeypatch.delenv(f"RADIXSERVE_{name}", raising=False)
        for name, value in env.items():
            monkeypatch.setenv(f"RADIXSERVE_{name}", value)
        bf16_layout.chosen.cache_clear()
        return bf16_layout.chosen()

    amx = {"avx512_bf16", "amx_bf16"}
    found.append(_found(pairs=True, unpack_from_rows=256, tiles_from_rows=16))
    assert choose(amx) == bf16_layout.Bf16Layout(True, 256, "measured on this CPU", 16)
    found.append(_found(pairs=False, unpack_from_rows=64))  # kept beside the kernels: not measured again
    assert choose(amx).pairs
    for path in Path(bf16_layout.envs.cache_dir()).rglob(bf16_layout.CACHE_FILE):
        path.unlink()
    assert not choose(amx).pairs
    assert choose(amx, BF16_LAYOUT="pairs") == bf16_layout.Bf16Layout(True, 64, "RADIXSERVE_BF16_LAYOUT=pairs")
    assert choose(amx, BF16_UNPACK_FROM_ROWS="512").unpack_from_rows == 512
    assert choose(amx, BF16_TILES_FROM_ROWS="4").tiles_from_rows == 4
    assert choose(amx, BF16_LAYOUT="pairs", BF16_UNPACK_FROM_ROWS="8").unpack_from_rows == 8
    found.clear()  # both row counts given with the pairs: nothing measured
    assert choose(amx, BF16_LAYOUT="pairs", BF16_UNPACK_FROM_ROWS="8", BF16_TILES_FROM_ROWS="2") == (
        bf16_layout.Bf16Layout(True, 8, "RADIXSERVE_BF16_LAYOUT=pairs", 2)
    )
    layout = choose({"avx512_bf16"})  # nothing below measures
    assert layout.pairs and layout.unpack_from_rows == layout.tiles_from_rows == bf16_layout.NEVER
    assert choose({"avx512_bf16"}, BF16_UNPACK_FROM_ROWS="32").unpack_from_rows == 32
    assert not choose({"avx512_bf16"}, BF16_LAYOUT="onednn").pairs
    with pytest.raises(ValueError, match="RADIXSERVE_BF16_LAYOUT='tiles'"):
        choose(amx, BF16_LAYOUT="tiles")
    with pytest.raises(ValueError, match="RADIXSERVE_BF16_UNPACK_FROM_ROWS='0'"):
        choose(amx, BF16_UNPACK_FROM_ROWS="0")
    with pytest.raises(ValueError, match="RADIXSERVE_BF16_TILES_FROM_ROWS='x'"):
        choose(amx, BF16_TILES_FROM_ROWS="x")


@needs_pairs
@pytest.mark.usefixtures("fresh_choice")
def test_measuring_times_both_layouts_and_keeps_what_it_found() -> None:
    """A (small) measurement, on a thread of its own as at a start, times both layouts at each decode row count, and
    the pairs' kernel, the pairs unpacked and oneDNN's layout at each larger one (and the AMX tiles at every one,
    where they serve). ``decide`` makes the choice of them (its rules: test_bf16_tiles). ``measured`` keeps it
    beside the compiled kernels."""
    from radixserve.runtime.threads import on_a_thread_of_its_own

    found = on_a_thread_of_its_own(
        lambda: bf16_layout.measure(weights=4, shape=(64, 128), decode_rows=(1, 3), many_rows=(64, 128), rounds=1), 2
    )
    assert found["weights"] == [4, 64, 128] and found["threads"] == 2
    decode, many = found["decode_ms"], found["many_rows_ms"]
    ways = {"pairs", "onednn"} | ({"tiles"} if bf16_kernels.tiles_ops() is not None else set())
    assert set(decode) == ways
    for way in ways:
        assert set(decode[way]) == {"1", "3"} and all(ms > 0 for ms in decode[way].values())
    assert set(many) == {"64", "128"} and all(set(t) == ways | {"unpacked"} for t in many.values())
    assert {k: v for k, v in found.items() if k in bf16_layout.decide(decode, many)} == bf16_layout.decide(decode, many)

    from radixserve.runtime.cpu_ext import build_dir

    kept = build_dir() / bf16_layout.CACHE_FILE
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_text(json.dumps(found))
    assert bf16_layout.measured() == found


@needs_pairs
def test_unpacking_gives_back_the_plain_weight_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(4)
    parts = [torch.randn(n, 96, generator=gen).to(torch.bfloat16) for n in (48, 32)]
    packed = packed_ops().pack(parts, 2)
    whole = torch.cat(parts)
    assert torch.equal(packed_ops().unpack(packed), whole)
    assert torch.equal(packed_ops().unpack(packed[1:4]), whole[16:64])  # a run of blocks: those rows
    with pytest.raises(RuntimeError, match="packed"):
        packed_ops().unpack(whole)


@needs_pairs
@pytest.mark.parametrize("slice_bytes", [None, 2 * 16 * 96 * 2])  # whole; two blocks a slice (uneven: 5 blocks)
def test_an_unpacked_product_is_the_pairs_kernels_within_rounding(
    monkeypatch: pytest.MonkeyPatch, slice_bytes: int | None
) -> None:
    """``unpacked_product`` gives what the pairs' kernel gives, with a bias, plain and gated (silu(gate) * up, as
    ``fused.silu_mul`` over the product), whole or a slice of output channels at a time."""
    if slice_bytes is not None:
        monkeypatch.setattr(bf16_kernels, "UNPACK_SLICE_BYTES", slice_bytes)
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(160, 96, generator=gen).to(torch.bfloat16)  # 10 blocks: gated, 5 gate and 5 up
    bias = torch.randn(160, generator=gen).to(torch.bfloat16)
    packed = packed_ops().pack([w], 1)
    x = torch.randn(70, 96, generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        want = torch.nn.functional.linear(x.float(), w.float(), bias.float())
        got = bf16_kernels.unpacked_product(x, packed, bias, False)
        assert got.shape == (70, 160) and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=1e-2 * want.abs().max().item())
        torch.testing.assert_close(bf16_kernels.unpacked_product(x, packed, None, False).float(), want - bias.float(),
                                   rtol=2e-2, atol=1e-2 * want.abs().max().item())  # fmt: skip
        gated = bf16_kernels.unpacked_product(x, packed, bias, True)
        kernel = packed_ops().linear_silu_mul(x, packed, bias)
        assert gated.shape == (70, 80)
        torch.testing.assert_close(gated.float(), kernel.float(), rtol=3e-2, atol=2e-2 * kernel.abs().max().item())
        if slice_bytes is None:  # whole, [gate; up] unpacks as it is and multiplies once: the bits of silu_mul
            assert torch.equal(gated, fused.silu_mul(bf16_kernels.unpacked_product(x, packed, bias, False)))


def test_a_timing_is_kept_for_later_starts_and_an_unwritable_cache_does_not_stop_a_start(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``measured.once`` times once and reads the kept file afterwards (a file without the expected keys, from an
    older version, is timed again); where the cache cannot be written the timing is used all the same."""
    from radixserve.runtime import measured

    calls: list[int] = []

    def timing() -> dict:
        calls.append(1)
        return {"a": len(calls)}

    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    assert measured.once("t.json", {"a"}, timing, "a test") == {"a": 1}
    assert measured.once("t.json", {"a"}, timing, "a test") == {"a": 1} and len(calls) == 1
    assert measured.once("t.json", {"a", "b"}, timing, "a test") == {"a": 2}  # older keys: timed again
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "file" / "cache"))
    (tmp_path / "file").write_text("not a folder")
    assert measured.once("t.json", {"a"}, timing, "a test") == {"a": 3}
