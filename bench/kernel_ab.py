"""The packed quantized kernel of two source trees, timed on a GGUF file's own tensors: the working tree against
a git revision (``--base``), each built like the engine builds it, run in alternating processes (one engine busy
at a time, the machine's drift shared by both), medians and ranges over the rounds.

    python -m bench.kernel_ab --base HEAD --file M/model-Q4_K_M.gguf --rows 1,16,256 --threads 1 --rounds 3

Each build is a separate process (two builds of the module cannot share one: pybind11 registers its types once);
a build is cached under ``<cache dir>/kernel-ab/<key>`` and reused while its sources are unchanged. Every row of
the table says whether both builds gave the same outputs: a change that alters the arithmetic shows there.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import zlib
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from bench.common import format_table, machine_summary

ROOT = Path(__file__).resolve().parents[1]
KERNEL_DIRS = ("runtime/csrc", "runtime/attention/csrc", "runtime/models/csrc")
DEFAULT_TENSORS = "blk.0.attn_q.weight,blk.0.ffn_up.weight,blk.0.ffn_down.weight,blk.1.ffn_down.weight"


def _sources(base: str | None, into: Path) -> Path:
    """The kernel sources of the working tree (``base`` None) or of a git revision, copied under ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    if base is None:
        for d in KERNEL_DIRS:
            for f in (ROOT / d).iterdir():
                if f.is_file():
                    (into / d).mkdir(parents=True, exist_ok=True)
                    (into / d / f.name).write_bytes(f.read_bytes())
        return into
    archive = subprocess.run(["git", "archive", base, *KERNEL_DIRS], cwd=ROOT, capture_output=True, check=True)
    with tempfile.TemporaryFile() as tmp:
        tmp.write(archive.stdout)
        tmp.seek(0)
        with tarfile.open(fileobj=tmp) as tar:
            if hasattr(tarfile, "data_filter"):  # Python 3.12+, and 3.10/3.11 patch releases that have it
                tar.extractall(into, filter="data")
            else:  # our own repository's archive
                tar.extractall(into)  # noqa: S202
    return into


def build(base: str | None) -> Path:
    """The built module (a ``.so``) of the working tree's or ``base``'s kernels."""
    from torch.utils import cpp_extension

    from radixserve.runtime.cpu_ext import CFLAGS, cpu_signature
    from radixserve.runtime.envs import cache_dir

    with tempfile.TemporaryDirectory() as tmp:
        src = _sources(base, Path(tmp))
        text = "\0".join(f"{p.relative_to(src)}\0{p.read_text()}" for p in sorted(src.rglob("*")) if p.is_file())
    key = hashlib.sha256("\0".join((text, " ".join(CFLAGS), cpu_signature())).encode()).hexdigest()[:16]
    folder = cache_dir() / "kernel-ab" / key
    name = f"kernel_ab_{key}"
    built = folder / f"{name}.so"
    if not built.is_file():
        _sources(base, folder / "src")
        # Not imported here (is_python_module=False): the parent builds both, and only one may register its types.
        cpp_extension.load(name=name, sources=[str(folder / "src/runtime/csrc/module.cpp")], extra_cflags=CFLAGS,
                           extra_ldflags=["-fopenmp"], build_directory=str(folder), verbose=False,
                           is_python_module=False)  # fmt: skip
    return built


def worker(so: Path, args: argparse.Namespace) -> None:
    """One process, one build: each tensor at each row count, timed for ``--budget`` seconds; JSON lines out."""
    import torch

    from radixserve.runtime.gguf_file import GGUFFile, ggml_type
    from radixserve.runtime.models.quant import QTYPES

    spec = importlib.util.spec_from_file_location(so.stem, so)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    op = module.quant_packed
    torch.set_num_threads(args.threads)
    with GGUFFile(args.file) as gguf, torch.inference_mode():
        chosen = {t.name: t for t in gguf.tensors if t.name in args.tensors.split(",")}
        for name, t in chosen.items():
            qtype = ggml_type(t.tensor_type)[0]
            if qtype not in QTYPES:
                continue
            n, k = t.shape
            try:
                w = op.pack(torch.from_numpy(gguf.data(t).copy()).reshape(n, -1), QTYPES[qtype], k)
            except RuntimeError:  # a build from before this block type had a packed kernel
                continue
            for rows in map(int, args.rows.split(",")):
                # The same x in both builds whatever either skipped: seeded by the tensor and the row count.
                gen = torch.Generator().manual_seed(zlib.crc32(f"{name}:{rows}".encode()))
                x = torch.randn(rows, k, generator=gen)
                y = op.linear(x, w, QTYPES[qtype], k, n)
                count, start = 0, time.perf_counter()
                while (elapsed := time.perf_counter() - start) < args.budget or count < 3:
                    op.linear(x, w, QTYPES[qtype], k, n)
                    count += 1
                rate = 2 * rows * k * n * count / elapsed / 1e9
                print(json.dumps({"tensor": name, "qtype": qtype, "shape": f"{k}x{n}", "rows": rows,
                                  "gflops": rate, "sum": float(y.double().abs().sum())}), flush=True)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--file", required=True, help="a GGUF file whose tensors to time")
    p.add_argument("--base", default="HEAD", help="git revision to compare the working tree against")
    p.add_argument("--tensors", default=DEFAULT_TENSORS, help="comma-separated GGUF tensor names")
    p.add_argument("--rows", default="1,16,256")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3, help="alternating runs of each build")
    p.add_argument("--budget", type=float, default=0.3, help="seconds per measurement")
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        worker(args.worker, args)
        return
    builds = {"base": build(args.base), "ours": build(None)}
    rates: dict[tuple[str, str, str, int], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    sums: dict[tuple[str, str, str, int], dict[str, float]] = defaultdict(dict)
    forwarded = ["--file", args.file, "--tensors", args.tensors, "--rows", args.rows, "--threads",
                 str(args.threads), "--budget", str(args.budget)]  # fmt: skip
    for r in range(args.rounds):
        for tag in ("base", "ours") if r % 2 == 0 else ("ours", "base"):
            out = subprocess.run([sys.executable, "-m", "bench.kernel_ab", "--worker", str(builds[tag]), *forwarded],
                                 cwd=ROOT, capture_output=True, text=True, check=True)  # fmt: skip
            for line in out.stdout.splitlines():
                row = json.loads(line)
                key = (row["tensor"], row["qtype"], row["shape"], row["rows"])
                rates[key][tag].append(row["gflops"])
                sums[key][tag] = row["sum"]
    table = []
    for key, by in rates.items():
        cells = {tag: f"{statistics.median(v):.1f} ({min(v):.0f}-{max(v):.0f})" if v else "n/a"
                 for tag, v in (("base", by["base"]), ("ours", by["ours"]))}  # fmt: skip
        if not (by["base"] and by["ours"]):  # one build has no packed kernel for this type
            table.append([*key, cells["base"], cells["ours"], "", ""])
            continue
        base, ours = statistics.median(by["base"]), statistics.median(by["ours"])
        same = sums[key]["base"] == sums[key]["ours"]
        table.append([*key, cells["base"], cells["ours"], f"{ours / base:.2f}x", "same" if same else "differ"])
    print(f"# packed kernel, {args.base} against the working tree, {args.threads} thread(s), {machine_summary()}")
    print(format_table(["tensor", "type", "K x N", "rows", "base GFLOP/s", "ours GFLOP/s", "ours/base", "outputs"],
                       table))  # fmt: skip


if __name__ == "__main__":
    main()
