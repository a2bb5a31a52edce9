"""Resident memory that loading a model adds, against the size of its weight files.

Each run is a fresh process: it imports the engine, loads the compiled kernels and the tokenizer (libraries, not
weights), notes its resident set (RSS, from /proc/self/status), loads the model with a KV pool of
``--max-total-tokens`` (256), waits for weights mapped at load to move into memory (``runtime.mapped_weights``), and
notes the RSS again and the peak (VmHWM). Printed per quantization mode: the
growth and the peak growth, both as a multiple of the file's bytes, and the peak over the file's bytes plus the
KV pool's (the models issue's measure). With ``--tp N`` each rank is a row: the leader as above, and each worker
process's own peak less the leader's baseline (a worker imports the same libraries); the file's share is 1/N.

    python -m bench.weights_memory                              # the built-in SmolLM2 (a Q4_1 GGUF)
    python -m bench.weights_memory --model PATH --modes none --dtype bfloat16   # a bf16 safetensors folder
    python -m bench.weights_memory --model PATH --modes none --dtype bfloat16 --tp 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence

from bench.common import format_table
from radixserve.runtime.model_source import resolve_model

_CHILD = r"""
import json, os, sys
def status(field, pid="self"):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
def workers():  # the tensor-parallel ranks this process spawned (not multiprocessing's resource tracker)
    for pid in os.listdir("/proc"):
        try:
            stat = open(f"/proc/{pid}/stat").read()
            cmd = open(f"/proc/{pid}/cmdline").read()
        except OSError:
            continue
        if pid.isdigit() and int(stat.rpartition(")")[2].split()[1]) == os.getpid() and "resource_tracker" not in cmd:
            yield pid
from radixserve.runtime.engine import Engine
from radixserve.runtime.cpu_ext import load_kernels
from radixserve.runtime.model_source import resolve_model
from radixserve.runtime.weights import load_tokenizer
load_kernels(), load_tokenizer(resolve_model(sys.argv[1]))  # libraries and the tokenizer are not weights
before = status("VmRSS")
model, mode, dtype, tokens, tp = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
engine = Engine(model=model, device="cpu", quantization=mode, dtype=dtype, max_total_tokens=tokens, tp=tp)
engine.weight_mover.done.wait()  # weights mapped at load have moved into memory of their own by now
after, peak = status("VmRSS"), status("VmHWM")
ranks = [status("VmHWM", pid) for pid in workers()]
kv = engine.core.runner.pool.nbytes
engine.shutdown()
print(json.dumps({"before": before, "after": after, "peak": peak, "workers": ranks, "kv": kv}))
"""


def measure(model: str, mode: str, dtype: str, tokens: int, tp: int) -> dict:
    argv = [sys.executable, "-c", _CHILD, model, mode, dtype, str(tokens), str(tp)]
    run = subprocess.run(argv, capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"measuring {mode} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--modes", default="auto,none")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-total-tokens", type=int, default=256, help="KV pool size in tokens")
    p.add_argument("--tp", type=int, default=1)
    args = p.parse_args(argv)
    folder = resolve_model(args.model)
    files = [f for f in folder.iterdir() if f.suffix in (".gguf", ".safetensors")]
    size = sum(f.resolve().stat().st_size for f in files)
    share = size / args.tp
    rows = []
    for mode in args.modes.split(","):
        m = measure(args.model, mode, args.dtype, args.max_total_tokens, args.tp)
        grown, peak, kv = m["after"] - m["before"], m["peak"] - m["before"], m["kv"]
        rows.append([f"{mode} rank 0", grown / 2**20, grown / share, peak / 2**20, peak / share, peak / (share + kv)])
        for rank, worker_peak in enumerate(m["workers"], start=1):
            w = worker_peak - m["before"]
            rows.append([f"{mode} rank {rank}", float("nan"), float("nan"), w / 2**20, w / share, w / (share + kv)])
    print(
        f"# resident memory added by loading {args.model} (--dtype {args.dtype}, --tp {args.tp}); files "
        f"{size / 2**20:.1f} MiB, {share / 2**20:.1f} MiB a rank; KV pool {m['kv'] / 2**20:.1f} MiB a rank"
    )
    headers = ["quantization", "RSS growth MiB", "x files", "peak growth MiB", "peak x files", "peak x (files+KV)"]
    print(format_table(headers, rows))


if __name__ == "__main__":
    main()
