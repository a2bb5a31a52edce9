"""What ``bench/gpu_check.py`` and ``bench/gpu_profile.py`` share: the test models' shapes, the target (GPU or a
dry run on the CPU), making the project importable on a machine where it is not installed, the sections'
reporting, the measured copy and matmul rates, and timed requests on the engine."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import threading
import time
import traceback
import zipfile
from dataclasses import dataclass
from pathlib import Path
from statistics import median

REPO = Path(__file__).resolve().parents[1]
SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "head_dim": 64, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "attention_bias": False, "mlp_bias": False,
}  # fmt: skip
LLAMA_8B = {
    **SMOLLM2, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
}  # fmt: skip
# --dry-run: every section but the kernels' on the CPU, at toy sizes, to check the script itself before a GPU run.
DRY_SHAPE = {**LLAMA_8B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}  # fmt: skip


@dataclass
class Target:
    """Where the check runs: the GPU, or (``--dry-run``) the CPU at toy sizes."""

    device: str = "cuda"
    dry: bool = False


TARGET = Target()



def setup(wheels: Path | None) -> Path:
    """Make ``radixserve`` and its missing packages importable; returns the scratch folder."""
    scratch = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    try:
        import radixserve.runtime  # noqa: F401
    except ImportError:
        pkg = scratch / "site" / "radixserve"
        pkg.mkdir(parents=True)
        for sub in ("radix", "constrained", "runtime"):
            (pkg / sub).symlink_to(REPO / sub)
        sys.path.insert(0, str(scratch / "site"))
    for module, wheel in (("llguidance", "llguidance-"), ("sortedcontainers", "sortedcontainers-")):
        try:
            __import__(module)
        except ImportError:
            found = sorted(wheels.glob(wheel + "*.whl")) if wheels else []
            if not found:
                raise SystemExit(f"{module} is missing: pass --wheels with its wheel") from None
            with zipfile.ZipFile(found[-1]) as z:
                z.extractall(scratch / "wheels")
            sys.path.insert(0, str(scratch / "wheels"))
    return scratch


def model_folder(root: Path, name: str, config: dict, tokenizer: Path) -> Path:
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    for f in tokenizer.iterdir():
        shutil.copy(f, folder / f.name)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def verdict(ok: bool, what: str) -> None:
    print(f"  {'PASS' if ok else 'FAIL'}: {what}", flush=True)


def section(name: str):  # noqa: ANN201 - a decorator
    def wrap(fn):  # noqa: ANN001, ANN202
        def run(*a, **kw):  # noqa: ANN002, ANN003, ANN202
            print(f"\n== {name} ==", flush=True)
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            except Exception:  # noqa: BLE001 - one section's fault must not hide the others' figures
                traceback.print_exc()
                print(f"  FAIL: {name} raised", flush=True)
            finally:
                print(f"  ({time.perf_counter() - start:.1f}s)", flush=True)

        return run

    return wrap


def sync() -> None:
    import torch

    if not TARGET.dry:
        torch.cuda.synchronize()


def release() -> None:
    """Give the allocator's cached blocks back, so that the next engine sizes its pool from free memory."""
    import gc

    import torch

    gc.collect()
    if not TARGET.dry:
        torch.cuda.empty_cache()


def measure_rates() -> tuple[float, float]:
    """(copy bandwidth in bytes/s, read + write, of a 4 GiB copy; bfloat16 matmul FLOP/s at 8192^3), medians."""
    import torch

    x = torch.empty((64 << 20) if TARGET.dry else (4 << 30), dtype=torch.uint8, device=TARGET.device)
    y = torch.empty_like(x)
    times = []
    for _ in range(12):
        sync()
        t = time.perf_counter()
        y.copy_(x)
        sync()
        times.append(time.perf_counter() - t)
    bw = 2 * x.numel() / median(times[2:])
    del x, y
    n = 1024 if TARGET.dry else 8192
    a = torch.randn(n, n, device=TARGET.device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=TARGET.device, dtype=torch.bfloat16)
    times = []
    for _ in range(20):
        sync()
        t = time.perf_counter()
        a @ b
        sync()
        times.append(time.perf_counter() - t)
    rate = 2 * n**3 / median(times[3:])
    del a, b
    release()
    return bw, rate


class Timed:
    """Runs requests on the engine and records when each one's first token and end arrived."""

    def __init__(self, eng) -> None:  # noqa: ANN001
        self.eng = eng

    def run(self, prompts: list[list[int]], params, abort_after: dict[int, float] | None = None) -> list[dict]:  # noqa: ANN001
        results = [dict(first=None, end=None, tokens=0, cached=0, error=None, times=[]) for _ in prompts]
        left = threading.Semaphore(0)
        start = time.perf_counter()
        rids = []
        for i, p in enumerate(prompts):

            def sink(out, r=results[i]) -> None:  # noqa: ANN001
                now = time.perf_counter() - start
                if out.token_ids and r["first"] is None:
                    r["first"] = now
                r["tokens"] += len(out.token_ids)
                if out.token_ids:
                    r["times"].append((now, r["tokens"]))
                if out.finished:
                    r["end"], r["cached"], r["error"] = now, out.cached_tokens, out.error
                    left.release()

            rids.append(self.eng.submit(p, params, sink))
        for i, delay in (abort_after or {}).items():
            threading.Timer(delay, self.eng.abort, (rids[i],)).start()
        for _ in prompts:
            if not left.acquire(timeout=600):
                raise TimeoutError("requests did not finish in 600 s")
        return results
