"""The GPU runtime's check, in one run on one CUDA GPU (an H200 in the figures of docs/benchmarks.md):

1. the Triton kernels on the device against the PyTorch reference;
2. agreement with HF transformers on a random-weight model of the built-in model's shape (SmolLM2-135M), the same
   weights in both: float32 greedy on 16 prompts, and bfloat16 top-1 agreement at teacher-forced positions;
3. decode of an 8B Llama-shaped random-weight model (``--load-format dummy``) at batch 1, 64 and 256 with 1K-token
   contexts, as a share of the HBM roofline (weight + KV bytes per step over the measured copy bandwidth);
4. prefill throughput as a share of the measured bfloat16 matmul rate;
5. TTFT of a 4K-token prompt cold and with its prefix cached;
6. a soak with aborts, then the KV accounting check.

The GPU machine has PyTorch, Triton and transformers and no package index: the project is imported from this
checkout (``radixserve`` is put on the path as a folder of links), and the two other packages the runtime imports
come as wheels in ``--wheels`` (``pip download --no-deps llguidance sortedcontainers``), unpacked to a temporary
folder when they are missing. ``--tokenizer`` is a folder with SmolLM2's ``tokenizer.json`` (both models use its
49,152-token vocabulary, as ``bench/real_models.py`` does).

    python bench/gpu_check.py --wheels W --tokenizer T [--soak-s 120] [--only kernels,hf,decode,...]

Each section prints its figures and a PASS/FAIL line against the acceptance bar; a section that raises prints its
traceback and the rest still run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import traceback
import zipfile
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
SECTIONS = ("kernels", "hf", "decode", "prefill", "ttft", "soak")  # and "profile", on request
# --dry-run: every section but the kernels' on the CPU, at toy sizes, to check the script itself before a GPU run.
DRY_SHAPE = {**LLAMA_8B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}  # fmt: skip
DEVICE = "cuda"
DRY = False


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


# --- 1. kernels --------------------------------------------------------------------------------------------------
@section("Triton kernels against the PyTorch reference, on the GPU")
def check_kernels() -> None:
    import torch

    from radixserve.runtime.attention.base import AttnOptions
    from radixserve.runtime.attention.torch_ref import TorchReferenceBackend
    from radixserve.runtime.attention.triton_attention import TritonBackend
    from radixserve.runtime.attention.triton_decode import decode_attention, num_splits
    from radixserve.runtime.kv_pool import KVPool
    from radixserve.runtime.step_layout import StepRow, lay_out

    dev = torch.device(DEVICE)
    worst = 0.0
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        for heads, kv_heads, dim, opts in ((32, 8, 128, AttnOptions()), (9, 3, 64, AttnOptions(window=100))):
            gen = torch.Generator().manual_seed(0)
            perm = torch.randperm(20000, generator=gen).tolist()
            lens, at, tables = [1, 37, 1000, 3000], 0, []
            for n in lens + [600, 900]:
                tables.append(perm[at : at + n])
                at += n
            rows = [StepRow([1], n - 1, t, True) for n, t in zip(lens, tables, strict=False)]
            rows.append(StepRow([1] * 600, 0, tables[4], False))  # a fresh chunk
            rows.append(StepRow([1] * 300, 600, tables[5], False))  # a chunk over a cached prefix
            _, _, meta = lay_out(rows, dev)
            t = meta.out_slots.numel()
            q, k, v = (torch.randn(t, hh, dim, device=dev).to(dtype) for hh in (heads, kv_heads, kv_heads))
            outs = []
            for backend in (TorchReferenceBackend(cpu_kernels=False), TritonBackend()):
                pool = KVPool(20000, 1, kv_heads, dim, dtype, dev)
                # The same contents in both pools (a generator seeded alike for each).
                same = torch.Generator().manual_seed(5)
                pool.kv[0].copy_(torch.randn(pool.kv[0].shape, generator=same).to(dev, dtype))
                outs.append(backend.forward(0, q, k, v, meta, pool, backend.prepare(meta, pool), opts).float())
            err = (outs[1] - outs[0]).abs().max().item()
            table = torch.zeros(len(lens), 4096, dtype=torch.int32, device=dev)
            for r, tab in enumerate(tables[: len(lens)]):
                table[r, : len(tab)] = torch.tensor(tab, dtype=torch.int32)
            nd = len(lens)
            dec = decode_attention(
                q[:nd].contiguous(), pool.kv[0], table, torch.arange(nd, device=dev),
                torch.tensor(lens, device=dev), num_splits(nd, kv_heads, dev), dim**-0.5, 0.0, opts.window or 0,
            )  # fmt: skip
            err_dec = (dec.float() - outs[0][:nd]).abs().max().item()
            print(f"  {str(dtype)[6:]:8s} heads {heads}/{kv_heads} dim {dim} {opts}: paged {err:.2e}, "
                  f"graph decode {err_dec:.2e}")  # fmt: skip
            worst = max(worst, err / tol, err_dec / tol)
    verdict(worst <= 1.0, "both kernels within tolerance of the reference (fp32 1e-4, bf16 3e-2)")

    # The decoder's elementwise ops: the residual add to the bit, the rest within a bfloat16 step.
    from radixserve.runtime.models import triton_ops
    from radixserve.runtime.models.fused import ref_rms_norm, ref_rope, ref_silu_mul

    ok = True
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1.6e-2)):
        x, r = (torch.randn(64, 4096, device=dev).to(dtype) for _ in range(2))
        w = torch.randn(4096, device=dev).to(dtype)
        res = r.clone()
        y = triton_ops.rms_norm(x, w, 1e-5, residual=res)
        exact = torch.equal(res, r + x)
        e1 = (y.float() - ref_rms_norm(r + x, w, 1e-5).float()).abs().max().item()
        qkv = torch.randn(64, 48 * 128, device=dev).to(dtype)
        qk = qkv[:, : 40 * 128].view(64, 40, 128)
        cos, sin = (torch.randn(64, 1, 128, device=dev).to(dtype) for _ in range(2))
        want = ref_rope(qk, cos, sin)
        e2 = (triton_ops.rope_(qk, cos, sin).float() - want.float()).abs().max().item()
        gu = torch.randn(64, 2 * 14336, device=dev).to(dtype)
        e3 = (triton_ops.silu_mul(gu).float() - ref_silu_mul(gu).float()).abs().max().item()
        print(f"  {str(dtype)[6:]:8s} residual add exact: {exact}; RMSNorm {e1:.2e}, RoPE {e2:.2e}, SiLU-mul {e3:.2e}")
        # RMSNorm's output may differ by a bfloat16 step of its largest values (|y| up to ~4 x |w|): scale the bar.
        ok &= exact and e1 <= tol * 16 and e2 <= tol * 8 and e3 <= tol * 8
    verdict(ok, "elementwise ops: the residual add bit-exact, the rest within a step of their dtype")

    # The sampler's counter-based uniforms: the same bits on the GPU as on the CPU.
    from radixserve.runtime.sampler import counter_uniforms

    seeds = torch.randint(-(2**63), 2**63 - 1, (4096,), dtype=torch.int64)
    counters = torch.randint(0, 2**40, (4096,), dtype=torch.int64)
    same = torch.equal(counter_uniforms(seeds, counters), counter_uniforms(seeds.to(dev), counters.to(dev)).cpu())
    verdict(same, "sampling uniforms: the GPU's equal the CPU's bit for bit")


# --- 2. agreement with HF ----------------------------------------------------------------------------------------
@section("Agreement with HF transformers (random-weight SmolLM2-135M shape, same weights)")
def check_hf(root: Path, tokenizer: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from radixserve.runtime.engine import Engine
    from radixserve.runtime.sampling_params import SamplingParams

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    folder = model_folder(root, "smollm2-random", SMOLLM2, tokenizer)
    torch.manual_seed(0)
    rope = {"rope_type": "default", "rope_theta": SMOLLM2["rope_theta"]}
    hf = LlamaForCausalLM(LlamaConfig(**SMOLLM2, rope_parameters=rope)).eval()
    hf.save_pretrained(folder, safe_serialization=True)
    (folder / "config.json").write_text(json.dumps(SMOLLM2, indent=2))  # ours, not HF's rewrite of it
    hf = hf.to(DEVICE, torch.float32)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(8, 120))] for _ in range(16)]
    n_new = 32
    want: list[list[int]] = []
    gaps: list[list[float]] = []
    with torch.inference_mode():
        for p in prompts:
            ids = list(p)
            gap = []
            for _ in range(n_new):
                logits = hf(torch.tensor([ids], device=DEVICE)).logits[0, -1].float()
                top2 = logits.topk(2).values
                gap.append((top2[0] - top2[1]).item())
                ids.append(int(logits.argmax()))
            want.append(ids[len(p) :])
            gaps.append(gap)
    eng = Engine(model=str(folder), device=DEVICE, dtype="float32", max_total_tokens=16384)
    try:
        got = [r["output_ids"] for r in eng.generate(
            input_ids=prompts, sampling_params=SamplingParams(max_new_tokens=n_new, temperature=0, ignore_eos=True))]
    finally:
        eng.shutdown()
    same = sum(g == w for g, w in zip(got, want, strict=True))
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g != w:
            j = next(k for k in range(n_new) if g[k] != w[k])
            print(f"  prompt {i}: first differs at token {j} (HF's top-2 logit gap there {gaps[i][j]:.2e})")
    print(f"  float32 greedy, {n_new} tokens: {same}/16 identical")
    verdict(same == 16, "float32 greedy identical to HF on 16/16 prompts")

    # bfloat16, teacher-forced: each position's top-1 on the float32 greedy sequences, ours against HF's.
    seqs = [p + w for p, w in zip(prompts, want, strict=True)]
    hf_top: list[list[int]] = []
    fp32_top: list[list[int]] = []
    with torch.inference_mode():
        for s in seqs:
            fp32_top.append(hf(torch.tensor([s], device=DEVICE)).logits[0, :-1].argmax(-1).tolist())
        hf = hf.to(torch.bfloat16)
        for s in seqs:
            hf_top.append(hf(torch.tensor([s], device=DEVICE)).logits[0, :-1].argmax(-1).tolist())
    del hf
    release()
    eng = Engine(model=str(folder), device=DEVICE, dtype="bfloat16", max_total_tokens=16384)
    try:
        ours = []
        for s in seqs:
            done = threading.Event()
            box: dict = {}

            def sink(out, box=box, done=done) -> None:  # noqa: ANN001
                if out.prompt_logprobs:
                    box.setdefault("lp", []).extend(out.prompt_logprobs)
                if out.finished:
                    done.set()

            params = SamplingParams(max_new_tokens=1, temperature=0, return_logprob=True, logprob_start_len=0,
                                    top_logprobs_num=1)  # fmt: skip
            eng.submit(s, params, sink)
            done.wait(60)
            ours.append([lp.top[0][0] for lp in box["lp"]])
    finally:
        eng.shutdown()
    total = agree = agree_hf32 = hf_vs_32 = 0
    for o, h, f in zip(ours, hf_top, fp32_top, strict=True):
        n = min(len(o), len(h))
        total += n
        agree += sum(a == b for a, b in zip(o[:n], h[:n], strict=True))
        agree_hf32 += sum(a == b for a, b in zip(o[:n], f[:n], strict=True))
        hf_vs_32 += sum(a == b for a, b in zip(h[:n], f[:n], strict=True))
    print(f"  bfloat16 top-1 at {total} teacher-forced positions: ours vs HF bf16 {agree / total:.1%}; "
          f"ours vs HF fp32 {agree_hf32 / total:.1%}; HF bf16 vs HF fp32 {hf_vs_32 / total:.1%}")  # fmt: skip
    verdict(agree / total >= 0.95, "bf16 top-1 agreement with HF >= 95%")


# --- 3-6: the 8B-shaped model ------------------------------------------------------------------------------------
def sync() -> None:
    import torch

    if not DRY:
        torch.cuda.synchronize()


def release() -> None:
    """Give the allocator's cached blocks back, so that the next engine sizes its pool from free memory."""
    import gc

    import torch

    gc.collect()
    if not DRY:
        torch.cuda.empty_cache()


def measure_rates() -> tuple[float, float]:
    """(copy bandwidth in bytes/s, read + write, of a 4 GiB copy; bfloat16 matmul FLOP/s at 8192^3), medians."""
    import torch

    x = torch.empty((64 << 20) if DRY else (4 << 30), dtype=torch.uint8, device=DEVICE)
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
    n = 1024 if DRY else 8192
    a = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
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


@section("Decode of the 8B-shaped model at batch 1, 64, 256 with 1K-token contexts, against the HBM roofline")
def check_decode(eng, bw: float) -> None:  # noqa: ANN001
    from radixserve.runtime.kv_pool import KVPool
    from radixserve.runtime.memory import module_bytes
    from radixserve.runtime.sampling_params import SamplingParams

    args = eng.call(lambda core: core.runner.model.args)
    weights = module_bytes(eng.call(lambda core: core.runner.model))
    per_token = KVPool.bytes_per_token(args.num_layers, args.num_kv_heads, args.head_dim, eng.dtype)
    rng = random.Random(1)
    shares = {}
    ctx = 64 if DRY else 1024
    # Enough new tokens that the first requests admitted still decode when the last one starts: the window from
    # the last first token to the first finish has every row decoding, in pure decode steps.
    for batch, new in ((1, 128), (64, 96), (256, 128)):
        if DRY:
            batch, new = batch // 16 or 1, 16
        prompts = [[rng.randrange(3, 49152) for _ in range(ctx)] for _ in range(batch)]
        res = Timed(eng).run(prompts, SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True))
        t0 = max(r["first"] for r in res)
        t1 = min(r["end"] for r in res)
        last = max(res, key=lambda r: r["first"])
        seen = [(t, n) for t, n in last["times"] if t <= t1]
        steps = seen[-1][1] - seen[0][1]
        if steps < 8:
            print(f"  batch {batch}: only {steps} steps with every row decoding; raise the new tokens")
            continue
        step = (seen[-1][0] - seen[0][0]) / steps
        moved = weights + batch * (ctx + new / 2) * per_token
        share = moved / step / bw
        shares[batch] = share
        print(f"  batch {batch:3d}: {step * 1e3:7.2f} ms/step over {steps} steps, {batch / step:8.0f} tok/s; "
              f"bytes/step {moved / 1e9:.2f} GB -> {moved / step / 1e12:.2f} TB/s = {share:.0%} of the roofline "
              f"(prefill done at {t0:.2f}s)")  # fmt: skip
        eng.call(lambda core: core.cache.flush())
    verdict(shares.get(1, 0) >= 0.60, "batch-1 decode >= 60% of the HBM roofline")
    verdict(shares.get(64, 0) >= 0.50, "batch-64 decode >= 50% of the HBM roofline")


@section("Prefill of the 8B-shaped model against the bf16 matmul rate")
def check_prefill(eng, mm: float) -> None:  # noqa: ANN001
    from radixserve.runtime.sampling_params import SamplingParams

    args = eng.call(lambda core: core.runner.model.args)
    model = eng.call(lambda core: core.runner.model)
    # Matmul FLOPs per token (the LM head runs once per prompt, not counted) and attention's per key.
    linear = sum(p.numel() for n, p in model.named_parameters() if "layers." in n and p.dim() == 2)
    attn_per_pair = 4 * args.num_heads * args.head_dim * args.num_layers
    rng = random.Random(2)
    for n_prompts, length in ((2, 64), (2, 128)) if DRY else ((8, 2048), (4, 4096)):
        prompts = [[rng.randrange(3, 49152) for _ in range(length)] for _ in range(n_prompts)]
        res = Timed(eng).run(prompts, SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True))
        wall = max(r["end"] for r in res)
        tokens = n_prompts * length
        flops = 2 * linear * tokens + attn_per_pair * n_prompts * length * (length + 1) / 2
        share = flops / wall / mm
        print(f"  {n_prompts} x {length} tokens: {wall:.3f} s, {tokens / wall:,.0f} tok/s, "
              f"{flops / wall / 1e12:.0f} TFLOP/s = {share:.0%} of the matmul rate")  # fmt: skip
        eng.call(lambda core: core.cache.flush())
    verdict(share >= 0.40, "prefill >= 40% of the bf16 matmul rate (4 x 4096)")


@section("TTFT of a 4K-token prompt, cold and with its prefix cached")
def check_ttft(eng) -> None:  # noqa: ANN001
    from radixserve.runtime.sampling_params import SamplingParams

    rng = random.Random(3)
    colds, warms = [], []
    for _ in range(3):
        prompt = [rng.randrange(3, 49152) for _ in range(256 if DRY else 4096)]
        params = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
        cold = Timed(eng).run([prompt], params)[0]
        warm = Timed(eng).run([prompt], params)[0]
        colds.append(cold["first"])
        warms.append(warm["first"])
        print(f"  cold {cold['first'] * 1e3:7.1f} ms (cached {cold['cached']}), warm {warm['first'] * 1e3:6.1f} ms "
              f"(cached {warm['cached']} tokens)")  # fmt: skip
    ratio = median(warms) / median(colds)
    print(f"  median warm / cold: {ratio:.1%}")
    verdict(ratio <= 0.10, "a cached 4K prefix brings TTFT to <= 10% of cold")


@section("Profile: where a decode step's time goes (8B shape, 1K contexts)")
def check_profile(eng, bw: float) -> None:  # noqa: ANN001
    """The graph replay alone, the decode kernel alone in a few tile configurations, the kernels of an eager
    step by GPU time, and an engine step split into the runner's part and the rest (Python)."""
    import torch

    from radixserve.runtime.attention.triton_decode import decode_attention, num_splits
    from radixserve.runtime.engine_core import EngineCore
    from radixserve.runtime.model_runner import ModelRunner
    from radixserve.runtime.sampling_params import SamplingParams

    eng.call(lambda core: core.cache.flush())
    ctx = 1024

    def replay(core, batch: int) -> float:  # noqa: ANN001
        g = core.runner.graphs
        pool = core.runner.pool
        t = g.table
        rows = torch.arange(batch, device="cuda")
        t.table[:batch, :ctx] = torch.randperm(batch * ctx, device="cuda").view(batch, ctx).to(torch.int32)
        bs = next(x for x in g.buckets if x >= batch)
        host, h = g._next_host()
        g._pad(h, 0, bs)
        h[1, :batch] = ctx - 1
        h[2, :batch] = pool.scratch_slot
        h[3, :batch] = rows.tolist()
        h[4, :batch] = ctx
        g.io[:, :bs].copy_(host[:, :bs])
        graph, _ = g._graphs[bs]
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
        # The rows' table entries go back to nobody's: later requests rewrite them (each table row is synced anew).
        t._entries.clear()
        t._free = list(range(t.pad_row - 1, -1, -1))
        return (time.perf_counter() - start) / 20

    args = eng.call(lambda core: core.runner.model.args)
    weights = eng.call(lambda core: sum(p.numel() * p.element_size() for p in core.runner.model.parameters()))
    for batch in (1, 64, 256):
        dt = eng.call(lambda core, b=batch: replay(core, b))
        moved = weights + batch * ctx * 131072
        print(f"  graph replay alone, batch {batch:3d}: {dt * 1e3:6.2f} ms = {moved / dt / bw:.0%} of the roofline")

    # The decode kernel alone over one layer's pool.
    def kernel(core) -> None:  # noqa: ANN001
        pool = core.runner.pool
        kv = pool.kv[0]
        for batch in (64, 256):
            table = torch.randperm(batch * ctx, device="cuda").view(batch, ctx).to(torch.int32)
            q = torch.randn(batch, args.num_heads, args.head_dim, device="cuda", dtype=torch.bfloat16)
            rows = torch.arange(batch, device="cuda")
            lens = torch.full((batch,), ctx, device="cuda")
            kv_bytes = batch * ctx * args.num_kv_heads * args.head_dim * 2 * 2
            default = num_splits(batch, args.num_kv_heads, q.device)
            best = None
            for block_n in (32, 64, 128):
                for warps in (4,):
                    for stages in (3,):
                        for splits in (1, 2, 4):
                            run = lambda: decode_attention(q, kv, table, rows, lens, splits, 0.088,  # noqa: E731, B023
                                                           block_n=block_n, num_warps=warps, num_stages=stages)  # noqa: B023
                            try:
                                run()
                            except Exception as exc:  # noqa: BLE001 - a configuration that does not fit
                                print(f"    {block_n}/{warps}/{stages}/{splits}: {type(exc).__name__}")
                                continue
                            torch.cuda.synchronize()
                            start = time.perf_counter()
                            for _ in range(20):
                                run()
                            torch.cuda.synchronize()
                            dt = (time.perf_counter() - start) / 20
                            if best is None or dt < best[0]:
                                best = (dt, block_n, warps, stages, splits)
                            if (block_n, splits) == (128 if batch <= 64 else 64, default):
                                print(f"    batch {batch}, default tiles and splits ({splits}): {dt * 1e6:.0f} us = "
                                      f"{kv_bytes / dt / bw:.0%} of the copy bandwidth")  # fmt: skip
            dt, *cfg = best
            print(f"  decode kernel, batch {batch}: best {dt * 1e6:.0f} us (BLOCK_N/warps/stages/splits {cfg}) = "
                  f"{kv_bytes / dt / bw:.0%} of the copy bandwidth")  # fmt: skip

    eng.call(kernel, timeout=300)

    # An eager decode step of 64 rows under the profiler: GPU time by kernel.
    def eager(core) -> str:  # noqa: ANN001
        from radixserve.runtime.attention.base import AttentionMetadata, ForwardContext
        from radixserve.runtime.cuda_graph import GraphDecodeBackend

        g, batch = core.runner.graphs, 64
        io = g.io
        meta = AttentionMetadata(out_slots=io[2, :batch], num_decode=batch, decode_slots=None, decode_mask=None,
                                 extends=())  # fmt: skip
        backend = GraphDecodeBackend(g.table, io[3, :batch], io[4, :batch], num_splits(batch, 8, io.device))
        with torch.inference_mode(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                core.runner.model(io[0, :batch], io[1, :batch], ForwardContext(meta, core.runner.pool, backend))
            torch.cuda.synchronize()
        events = prof.key_averages()
        try:
            return events.table(sort_by="self_device_time_total", row_limit=14)
        except Exception:  # noqa: BLE001 - older torch names the column after CUDA
            return events.table(sort_by="self_cuda_time_total", row_limit=14)

    print(eng.call(eager, timeout=120))

    # An engine step, split: the runner's part (launch, sync, sample) and the rest (schedule, apply, outputs).
    timing = {"step": 0.0, "run": 0.0, "graph": 0.0, "n": 0}
    orig_step, orig_run = EngineCore.step, ModelRunner._run

    def step(self):  # noqa: ANN001, ANN202
        t = time.perf_counter()
        out = orig_step(self)
        timing["step"] += time.perf_counter() - t
        timing["n"] += 1
        return out

    def run(self, plan):  # noqa: ANN001, ANN202
        t = time.perf_counter()
        out = orig_run(self, plan)
        timing["run"] += time.perf_counter() - t
        return out

    rng = random.Random(5)
    for batch in (1, 64):
        prompts = [[rng.randrange(3, 49152) for _ in range(ctx)] for _ in range(batch)]
        Timed(eng).run(prompts, SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True))  # admit/compile
        EngineCore.step, ModelRunner._run = step, run
        timing.update(step=0.0, run=0.0, n=0)
        try:
            Timed(eng).run([p + [7] for p in prompts], SamplingParams(max_new_tokens=64, temperature=0,
                                                                     ignore_eos=True))  # fmt: skip
        finally:
            EngineCore.step, ModelRunner._run = orig_step, orig_run
        n = timing["n"]
        print(f"  engine, batch {batch}: {timing['step'] / n * 1e3:.2f} ms/step over {n} steps, of which the runner "
              f"{timing['run'] / n * 1e3:.2f} ms, the rest {(timing['step'] - timing['run']) / n * 1e3:.2f} ms")
        eng.call(lambda core: core.cache.flush())


@section("Soak with aborts, then the KV accounting")
def check_soak(eng, seconds: float) -> None:  # noqa: ANN001
    from radixserve.runtime.sampling_params import SamplingParams

    rng = random.Random(4)
    sizes = (16, 64) if DRY else (256, 1024, 2048)
    shared = [[rng.randrange(3, 49152) for _ in range(rng.choice(sizes))] for _ in range(6)]
    deadline = time.perf_counter() + seconds
    done = errors = aborted = waves = 0
    while time.perf_counter() < deadline:
        prompts = []
        for _ in range(8 if DRY else 48):
            head = rng.choice(shared) if rng.random() < 0.7 else []
            prompts.append(head + [rng.randrange(3, 49152) for _ in range(rng.randint(1, 32 if DRY else 512))])
        aborts = {i: rng.uniform(0.0, 1.5) for i in range(len(prompts)) if rng.random() < 0.25}
        new = rng.randint(1, 8 if DRY else 96)
        temp = 0.8 if waves % 2 else 0.0  # sampled waves and greedy ones (which overlap their steps)
        res = Timed(eng).run(prompts, SamplingParams(max_new_tokens=new, temperature=temp, ignore_eos=True), aborts)
        waves += 1
        done += len(res)
        errors += sum(r["error"] is not None for r in res)
        aborted += len(aborts)
    time.sleep(0.5)
    info = eng.server_info()
    kv = info["kv_cache"]
    eng.call(lambda core: core.cache.check(core.scheduler.holders()))  # raises on any slot not accounted for
    overlapped = eng.call(lambda core: core.stats.overlapped_steps)
    print(f"  {waves} waves, {done} requests ({aborted} aborted on a timer), {errors} errors; {overlapped} steps "
          f"overlapped so far; KV: {kv}")  # fmt: skip
    ok = (kv["in_use_tokens"] == 0 and kv["free_tokens"] + kv["evictable_tokens"] == kv["total_tokens"]
          and info["num_running_requests"] == 0 and errors == 0 and eng.alive)  # fmt: skip
    verdict(ok, "after the soak every KV slot is free or cached, none leaked; no errors; the engine serves")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheels", type=Path, default=REPO / ".cache" / "gpu-check" / "wheels")
    ap.add_argument("--tokenizer", type=Path, default=REPO / ".cache" / "gpu-check" / "tokenizer")
    ap.add_argument("--soak-s", type=float, default=120.0)
    ap.add_argument("--only", default=",".join(SECTIONS))
    ap.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU: checks the script, measures nothing")
    opts = ap.parse_args()
    global DEVICE, DRY
    if opts.dry_run:
        DEVICE, DRY = "cpu", True
        opts.soak_s = min(opts.soak_s, 10.0)
    only = set(opts.only.split(","))
    start = time.perf_counter()
    scratch = setup(opts.wheels if opts.wheels.is_dir() else None)
    os.environ.setdefault("RADIXSERVE_LOG_LEVEL", "INFO")
    import logging

    import torch
    import triton

    logging.basicConfig(level=logging.INFO, format="  [%(name)s] %(message)s")
    if DRY:
        print(f"dry run on the CPU; torch {torch.__version__}, triton {triton.__version__}", flush=True)
    else:
        props = torch.cuda.get_device_properties(0)
        print(f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs; torch "
              f"{torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}", flush=True)  # fmt: skip
    if "kernels" in only and not DRY:
        check_kernels()
    if "hf" in only:
        check_hf(scratch, opts.tokenizer)
    if only & {"decode", "prefill", "ttft", "soak", "profile"}:
        from radixserve.runtime.engine import Engine

        release()
        bw, mm = measure_rates()
        print(f"\nmeasured: copy {bw / 1e12:.2f} TB/s (read + write), bf16 matmul {mm / 1e12:.0f} TFLOP/s", flush=True)
        folder = model_folder(scratch, "llama-8b-shape", DRY_SHAPE if DRY else LLAMA_8B, opts.tokenizer)
        t = time.perf_counter()
        eng = Engine(model=str(folder), device=DEVICE, dtype="float32" if DRY else "bfloat16", load_format="dummy",
                     max_running_requests=256, chunked_prefill_size=8192,
                     max_total_tokens=60000 if DRY else 0)  # fmt: skip
        print(f"8B-shaped engine up in {time.perf_counter() - t:.1f}s", flush=True)
        try:
            if "decode" in only:
                check_decode(eng, bw)
            if "prefill" in only:
                check_prefill(eng, mm)
            if "ttft" in only:
                check_ttft(eng)
            if "profile" in only:
                check_profile(eng, bw)
            if "soak" in only:
                check_soak(eng, opts.soak_s)
        finally:
            eng.shutdown()
    shutil.rmtree(scratch, ignore_errors=True)
    print(f"\ntotal {time.perf_counter() - start:.0f}s", flush=True)


if __name__ == "__main__":
    main()
