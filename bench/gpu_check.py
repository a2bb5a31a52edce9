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

(``python -m bench.gpu_check`` from the checkout works the same.) Helpers are in ``bench/gpu_common.py``, the
optional ``profile`` section in ``bench/gpu_profile.py``.

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
import threading
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: ``bench`` from the checkout

from bench.gpu_common import (  # noqa: E402
    DRY_SHAPE,
    LLAMA_8B,
    REPO,
    SMOLLM2,
    TARGET,
    Timed,
    measure_rates,
    model_folder,
    release,
    section,
    setup,
    verdict,
)  # fmt: skip
from bench.gpu_profile import check_profile  # noqa: E402

SECTIONS = ("kernels", "hf", "decode", "prefill", "ttft", "soak")  # and "profile", on request


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

    dev = torch.device(TARGET.device)
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
    hf = hf.to(TARGET.device, torch.float32)
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
                logits = hf(torch.tensor([ids], device=TARGET.device)).logits[0, -1].float()
                top2 = logits.topk(2).values
                gap.append((top2[0] - top2[1]).item())
                ids.append(int(logits.argmax()))
            want.append(ids[len(p) :])
            gaps.append(gap)
    eng = Engine(model=str(folder), device=TARGET.device, dtype="float32", max_total_tokens=16384)
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
            fp32_top.append(hf(torch.tensor([s], device=TARGET.device)).logits[0, :-1].argmax(-1).tolist())
        hf = hf.to(torch.bfloat16)
        for s in seqs:
            hf_top.append(hf(torch.tensor([s], device=TARGET.device)).logits[0, :-1].argmax(-1).tolist())
    del hf
    release()
    eng = Engine(model=str(folder), device=TARGET.device, dtype="bfloat16", max_total_tokens=16384)
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
    ctx = 64 if TARGET.dry else 1024
    # Enough new tokens that the first requests admitted still decode when the last one starts: the window from
    # the last first token to the first finish has every row decoding, in pure decode steps.
    for batch, new in ((1, 128), (64, 96), (256, 128)):
        if TARGET.dry:
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
    for n_prompts, length in ((2, 64), (2, 128)) if TARGET.dry else ((8, 2048), (4, 4096)):
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
        prompt = [rng.randrange(3, 49152) for _ in range(256 if TARGET.dry else 4096)]
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


@section("Soak with aborts, then the KV accounting")
def check_soak(eng, seconds: float) -> None:  # noqa: ANN001
    from radixserve.runtime.sampling_params import SamplingParams

    rng = random.Random(4)
    sizes = (16, 64) if TARGET.dry else (256, 1024, 2048)
    shared = [[rng.randrange(3, 49152) for _ in range(rng.choice(sizes))] for _ in range(6)]
    deadline = time.perf_counter() + seconds
    done = errors = aborted = waves = 0
    while time.perf_counter() < deadline:
        prompts = []
        for _ in range(8 if TARGET.dry else 48):
            head = rng.choice(shared) if rng.random() < 0.7 else []
            prompts.append(head + [rng.randrange(3, 49152) for _ in range(rng.randint(1, 32 if TARGET.dry else 512))])
        aborts = {i: rng.uniform(0.0, 1.5) for i in range(len(prompts)) if rng.random() < 0.25}
        new = rng.randint(1, 8 if TARGET.dry else 96)
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
    if opts.dry_run:
        TARGET.device, TARGET.dry = "cpu", True
        opts.soak_s = min(opts.soak_s, 10.0)
    only = set(opts.only.split(","))
    start = time.perf_counter()
    scratch = setup(opts.wheels if opts.wheels.is_dir() else None)
    os.environ.setdefault("RADIXSERVE_LOG_LEVEL", "INFO")
    import logging

    import torch
    import triton

    logging.basicConfig(level=logging.INFO, format="  [%(name)s] %(message)s")
    if TARGET.dry:
        print(f"dry run on the CPU; torch {torch.__version__}, triton {triton.__version__}", flush=True)
    else:
        props = torch.cuda.get_device_properties(0)
        print(f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs; torch "
              f"{torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}", flush=True)  # fmt: skip
    if "kernels" in only and not TARGET.dry:
        check_kernels()
    if "hf" in only:
        check_hf(scratch, opts.tokenizer)
    if only & {"decode", "prefill", "ttft", "soak", "profile"}:
        from radixserve.runtime.engine import Engine

        release()
        bw, mm = measure_rates()
        print(f"\nmeasured: copy {bw / 1e12:.2f} TB/s (read + write), bf16 matmul {mm / 1e12:.0f} TFLOP/s", flush=True)
        folder = model_folder(scratch, "llama-8b-shape", DRY_SHAPE if TARGET.dry else LLAMA_8B, opts.tokenizer)
        t = time.perf_counter()
        dtype = "float32" if TARGET.dry else "bfloat16"
        eng = Engine(model=str(folder), device=TARGET.device, dtype=dtype, load_format="dummy",
                     max_running_requests=256, chunked_prefill_size=8192,
                     max_total_tokens=60000 if TARGET.dry else 0)  # fmt: skip
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
