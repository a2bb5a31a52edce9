"""What serving a LoRA adapter costs: decode with an adapter against the base model, in one engine.

Writes a random adapter in PEFT's format for the model's shapes (every attention and MLP projection, rank
``--rank``), starts one engine with it (``--lora-modules``), and alternates greedy generations with and without
the adapter: one user, then ``--batch`` users at once, and the same batch half with the adapter (a step mixing
adapter and base rows). Prints decode tok/s per case (median over ``--rounds``) and the ratio to the base model.

    python -m bench.lora                       # SmolLM2-135M, dtype auto, rank 16
    python -m bench.lora --rank 64 --quantization none

``--peers`` serves the same adapter with ``radixserve serve`` (plain bfloat16 weights) and with vLLM's CPU build
(``--enable-lora``, through ``../shared/peers/vllm-cpu.sh``), one after the other, and sends each the peer
benchmark's one-user and 16-user workloads with the adapter as the model (``bench.peers``), printing the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.common import format_table, machine_summary
from radixserve.runtime.engine import Engine
from radixserve.runtime.model_source import resolve_model
from radixserve.runtime.sampling_params import SamplingParams
from radixserve.runtime.weights import load_hf_config

PROJECTIONS = {
    "self_attn.q_proj": ("hidden", "q"),
    "self_attn.k_proj": ("hidden", "kv"),
    "self_attn.v_proj": ("hidden", "kv"),
    "self_attn.o_proj": ("q", "hidden"),
    "mlp.gate_proj": ("hidden", "mlp"),
    "mlp.up_proj": ("hidden", "mlp"),
    "mlp.down_proj": ("mlp", "hidden"),
}


def write_adapter(folder: Path, hf_config: object, rank: int, seed: int = 0) -> Path:
    """A random rank-``rank`` adapter of every projection, as PEFT saves one."""
    config = vars(hf_config)
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    sizes = {
        "hidden": config["hidden_size"],
        "q": config["num_attention_heads"] * head,
        "kv": config.get("num_key_value_heads", config["num_attention_heads"]) * head,
        "mlp": config["intermediate_size"],
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (inn, out) in PROJECTIONS.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, sizes[inn], generator=gen) / sizes[inn] ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(sizes[out], rank, generator=gen) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    targets = sorted({m.rpartition(".")[2] for m in PROJECTIONS})
    adapter = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets, "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(adapter))
    return folder


def decode_rate(engine: Engine, prompts: list[list[int]], loras: list[str | None], new: int) -> float:
    """Output tok/s of the prompts generated together, prefill excluded (the time of 1 token is subtracted)."""

    def run(n: int) -> float:
        params = [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, lora_name=x) for x in loras]
        start = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params=params)
        return time.perf_counter() - start

    first = run(1)
    return len(prompts) * (new - 1) / max(1e-9, run(new) - first)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--peers", action="store_true", help="served, against vLLM-CPU with the same adapter")
    args = p.parse_args()
    if args.peers:
        return peers(args)
    folder = resolve_model(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        adapter = write_adapter(Path(tmp) / "adapter", load_hf_config(folder), args.rank)
        engine = Engine(model=args.model, dtype=args.dtype, quantization=args.quantization,
                        lora_modules=(f"bench={adapter}",))  # fmt: skip
        try:
            prompts = [engine.tokenizer.encode(f"Write a long story about the number {i}.") for i in range(args.batch)]
            half = ["bench" if i % 2 else None for i in range(args.batch)]
            cases = {
                "one user": ([prompts[0]], [None], [["bench"]]),
                f"{args.batch} users": (prompts, [None] * args.batch, [["bench"] * args.batch, half]),
            }
            for ps, base, others in cases.values():  # warm-up: kernels, thread counts, the prompts' KV cached
                for loras in [base, *others]:
                    decode_rate(engine, ps, loras, 8)
            rows = []
            for case, (ps, base, others) in cases.items():
                rates: dict[str, list[float]] = {}
                for _ in range(args.rounds):
                    for loras in [base, *others]:
                        label = "base" if loras == base else "adapter" if None not in loras else "half adapter"
                        rates.setdefault(label, []).append(decode_rate(engine, ps, loras, args.new_tokens))
                ref = statistics.median(rates["base"])
                for label, values in rates.items():
                    rows.append([case, label, statistics.median(values), statistics.median(values) / ref])
        finally:
            engine.shutdown()
    print(f"\n# LoRA rank {args.rank}, every projection; {machine_summary()}")
    print(format_table(["case", "rows", "decode tok/s", "x base"], rows))


def peers(args: argparse.Namespace) -> None:
    from bench.common import safetensors_folder
    from bench.peer_workloads import one_user, sixteen_users
    from bench.peers import bench_engine, radixserve, report, summary, vllm
    from radixserve.runtime.weights import load_tokenizer

    folder = resolve_model(args.model)
    tokenizer = load_tokenizer(folder)
    workloads = [one_user(tokenizer), sixteen_users(tokenizer)]
    with tempfile.TemporaryDirectory() as tmp:
        adapter = write_adapter(Path(tmp) / "adapter", load_hf_config(folder), args.rank)
        ours = f"--quantization none --lora-modules bench={adapter}"
        theirs = f"--enable-lora --lora-modules bench={adapter} --max-lora-rank {args.rank} --max-loras 1"
        rounds = []
        for i in range(args.rounds):
            print(f"round {i + 1} of {args.rounds}", flush=True)
            results = {
                "radixserve": bench_engine("radixserve", radixserve(args.model, ours), workloads, tokenizer, "bench"),
                "vllm": bench_engine("vllm", vllm(safetensors_folder(folder), theirs), workloads, tokenizer, "bench"),
            }
            print(report(results, workloads))
            rounds.append(results)
    print(f"\n# LoRA rank {args.rank}, served; medians over {args.rounds} rounds; {machine_summary()}")
    print(summary(rounds, workloads))


if __name__ == "__main__":
    main()
