"""Load time against reading the files, and serving a large model next to a large KV pool.

For a safetensors folder (``python -m bench.real_models 3b`` writes a ~3B Llama shape, 6 GB of bf16):
1. the time to read every weight file once, sequentially, into one reused 64 MiB buffer (what the disk, or the
   page cache, gives);
2. in a fresh process, an engine on that folder (``--dtype bfloat16``, ``--quantization none``, a KV pool of
   ``--kv-gib`` GiB): its load time (building the model, reading, cutting and packing the weights, from
   ``Engine.load_seconds``), its resident memory and peak, then one greedy request of 32 tokens.
Run alternately ``--runs`` times; with ``--cold`` the page cache is dropped before each read and each load (needs
root), otherwise both read warm files (a first read warms them). Printed: the medians and load / read.

A ``.gguf`` file is loaded as served by default (``--dtype auto``, ``--quantization auto``: its blocks kept,
packed for the CPU kernel) and compared with reading that one file.

    python -m bench.load_time --model ~/.cache/radixserve/bench-models/random-llama-3b --kv-gib 4 --cold
    python -m bench.load_time --model ~/.cache/radixserve/bench-models/random-llama-1b/model-Q4_K_M.gguf --cold
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench.common import format_table
from radixserve.runtime.kv_pool import KVPool
from radixserve.runtime.model_source import resolve_model
from radixserve.runtime.models.args import ModelArgs
from radixserve.runtime.weights import load_hf_config, safetensors_files

_CHILD = r"""
import json, sys, time
def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
from radixserve.runtime.engine import Engine
from radixserve.runtime.sampling_params import SamplingParams
if __name__ == "__main__":
    before = status("VmRSS")
    gguf = sys.argv[1].endswith(".gguf")
    engine = Engine(model=sys.argv[1], device="cpu", dtype="auto" if gguf else "bfloat16",
                    quantization="auto" if gguf else "none", max_total_tokens=int(sys.argv[2]))
    rss, peak = status("VmRSS"), status("VmHWM")
    start = time.perf_counter()
    out = engine.generate(["Summarize the history of the printing press in three sentences."],
                          [SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)])[0]
    seconds = time.perf_counter() - start
    kv = engine.core.runner.pool.nbytes
    engine.shutdown()
    print(json.dumps({"load": engine.load_seconds, "before": before, "rss": rss, "peak": peak, "kv": kv,
                      "tokens": len(out["output_ids"]), "generate_s": seconds}))
"""


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def read_files(files: list[Path]) -> float:
    buf = bytearray(64 << 20)
    view = memoryview(buf)
    start = time.perf_counter()
    for file in files:
        with open(file, "rb", buffering=0) as f:
            while f.readinto(view):
                pass
    return time.perf_counter() - start


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--kv-gib", type=float, default=4.0)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--cold", action="store_true", help="drop the page cache before each read and load (root)")
    args = p.parse_args(argv)
    folder = resolve_model(args.model)
    gguf = args.model.endswith(".gguf")
    files = [Path(args.model).expanduser().resolve()] if gguf else safetensors_files(folder)
    size = sum(f.stat().st_size for f in files)
    margs = ModelArgs.from_hf_config(load_hf_config(folder))
    import torch

    per_token = KVPool.bytes_per_token(margs.num_layers, margs.num_kv_heads, margs.head_dim, torch.bfloat16)
    tokens = int(args.kv_gib * 2**30 // per_token)
    if not args.cold:
        read_files(files)
    reads, loads, results = [], [], []
    for _ in range(args.runs):
        if args.cold:
            drop_caches()
        reads.append(read_files(files))
        if args.cold:
            drop_caches()
        model = str(files[0]) if gguf else str(folder)
        run = subprocess.run([sys.executable, "-c", _CHILD, model, str(tokens)], capture_output=True, text=True)
        if run.returncode:
            raise SystemExit(f"the engine failed:\n{run.stderr[-3000:]}")
        results.append(json.loads(run.stdout.strip().splitlines()[-1]))
        loads.append(results[-1]["load"])
    last = results[-1]
    gib = 2**30
    print(
        f"# {folder.name}: {size / gib:.2f} GiB of weight files, {margs.num_layers} layers; KV pool {tokens} tokens "
        f"({last['kv'] / gib:.2f} GiB); page cache {'dropped before each' if args.cold else 'warm'}"
    )
    rows = [
        ["read the files (s)", statistics.median(reads), " ".join(f"{x:.2f}" for x in reads)],
        ["engine load (s)", statistics.median(loads), " ".join(f"{x:.2f}" for x in loads)],
        ["load / read", statistics.median(loads) / statistics.median(reads), ""],
        ["resident after start (GiB)", (last["rss"] - last["before"]) / gib, ""],
        ["peak (GiB)", (last["peak"] - last["before"]) / gib, ""],
        ["peak / (weights + KV)", (last["peak"] - last["before"]) / (size + last["kv"]), ""],
        ["greedy tokens, tok/s", last["tokens"], f"{last['tokens'] / last['generate_s']:.2f} tok/s"],
    ]
    print(format_table(["measure", "median", "runs"], rows))


if __name__ == "__main__":
    main()
