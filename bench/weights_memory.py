"""Resident memory that loading a model adds, against the size of its weight files.

Each run is a fresh process: it imports the engine, loads the compiled kernels and the tokenizer (libraries, not
weights), notes its resident set (RSS, from /proc/self/status), loads the model with a KV pool of 256 tokens,
and notes the RSS again and the peak (VmHWM). Printed per quantization
mode: the growth and the peak growth, and both as a multiple of the file's bytes.

    python -m bench.weights_memory                              # the built-in SmolLM2 (a Q4_1 GGUF)
    python -m bench.weights_memory --model PATH --modes none --dtype bfloat16   # a bf16 safetensors folder
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
import json, sys
def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
from radixserve.runtime.engine import Engine
from radixserve.runtime.cpu_ext import load_kernels
from radixserve.runtime.model_source import resolve_model
from radixserve.runtime.weights import load_tokenizer
load_kernels(), load_tokenizer(resolve_model(sys.argv[1]))  # libraries and the tokenizer are not weights
before = status("VmRSS")
engine = Engine(model=sys.argv[1], device="cpu", quantization=sys.argv[2], dtype=sys.argv[3], max_total_tokens=256)
after, peak = status("VmRSS"), status("VmHWM")
engine.shutdown()
print(json.dumps({"before": before, "after": after, "peak": peak}))
"""


def measure(model: str, mode: str, dtype: str) -> dict[str, int]:
    argv = [sys.executable, "-c", _CHILD, model, mode, dtype]
    run = subprocess.run(argv, capture_output=True, text=True, check=True)
    return json.loads(run.stdout.strip().splitlines()[-1])


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--modes", default="auto,none")
    p.add_argument("--dtype", default="auto")
    args = p.parse_args(argv)
    folder = resolve_model(args.model)
    files = [f for f in folder.iterdir() if f.suffix in (".gguf", ".safetensors")]
    size = sum(f.resolve().stat().st_size for f in files)
    rows = []
    for mode in args.modes.split(","):
        m = measure(args.model, mode, args.dtype)
        grown, peak = m["after"] - m["before"], m["peak"] - m["before"]
        rows.append([mode, grown / 2**20, grown / size, peak / 2**20, peak / size])
    print(f"# resident memory added by loading {args.model} (--dtype {args.dtype}); files {size / 2**20:.1f} MiB")
    print(format_table(["quantization", "RSS growth MiB", "x files", "peak growth MiB", "peak x files"], rows))


if __name__ == "__main__":
    main()
