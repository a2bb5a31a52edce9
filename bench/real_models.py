"""Random-weight models of real shapes, written once for the benchmarks: HF folders (bf16 safetensors, the
SmolLM2 tokenizer) and, for llama.cpp, an F32 GGUF and its ``llama-quantize`` conversions.

Speed at realistic sizes depends on the shapes, not on the values, so random weights (normal, std 0.02, as at
initialization) measure what a real checkpoint of that shape would cost. Written under the benchmark cache
(``RADIXSERVE_CACHE_DIR``/bench-models), never in the repository.

    python -m bench.real_models 1b                     # writes the folder, prints its path
    python -m bench.real_models 1b --gguf Q8_0,Q4_K_M  # and the GGUFs llama.cpp makes of it
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.peers import PEERS
from radixserve.runtime import envs
from radixserve.runtime.model_source import resolve_model

# Llama-3.2-1B's and -3B's and Llama-3.1-8B's layer shapes, with SmolLM2's 49,152-token vocabulary.
SHAPES: dict[str, dict[str, int]] = {
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8},
    "3b": {"hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24,
           "num_key_value_heads": 8},
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8},
}  # fmt: skip
VOCAB = 49152


def folder_of(name: str) -> Path:
    return envs.cache_dir() / "bench-models" / f"random-llama-{name}"


def write_model(name: str) -> Path:
    """The HF folder of shape ``name`` (written once; a finished folder has its config.json written last)."""
    out = folder_of(name)
    if (out / "config.json").is_file():
        return out
    shape = SHAPES[name]
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = resolve_model("smollm2-135m-instruct")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (tokenizer / f).is_file():
            shutil.copy(tokenizer / f, out / f)
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = h // heads
    gen = torch.Generator().manual_seed(0)

    def rand(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=gen) * 0.02).to(torch.bfloat16)

    index: dict[str, str] = {}
    for layer in range(-1, layers):  # one shard per layer, so memory stays at one layer's weights
        if layer < 0:
            tensors = {"model.embed_tokens.weight": rand(VOCAB, h), "model.norm.weight": torch.ones(h).bfloat16()}
        else:
            tensors = layer_tensors(f"model.layers.{layer}.", h, inter, heads, kv, head_dim, rand)
        shard = f"model-{layer + 1:05d}-of-{layers + 1:05d}.safetensors"
        save_file(tensors, str(out / shard), metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, shard))
        print(f"  wrote {shard}", file=sys.stderr, flush=True)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, **shape,
        "head_dim": head_dim, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def layer_tensors(
    p: str,
    h: int,
    inter: int,
    heads: int,
    kv: int,
    head_dim: int,
    rand: Callable[..., torch.Tensor],
    qk_norm: bool = False,
) -> dict[str, torch.Tensor]:
    """One decoder layer's random bf16 weights under the HF names starting ``p`` (norms 1; Qwen3's q/k norms with
    ``qk_norm``)."""
    tensors = {
        p + "self_attn.q_proj.weight": rand(heads * head_dim, h),
        p + "self_attn.k_proj.weight": rand(kv * head_dim, h),
        p + "self_attn.v_proj.weight": rand(kv * head_dim, h),
        p + "self_attn.o_proj.weight": rand(h, heads * head_dim),
        p + "mlp.gate_proj.weight": rand(inter, h),
        p + "mlp.up_proj.weight": rand(inter, h),
        p + "mlp.down_proj.weight": rand(h, inter),
        p + "input_layernorm.weight": torch.ones(h).bfloat16(),
        p + "post_attention_layernorm.weight": torch.ones(h).bfloat16(),
    }
    if qk_norm:
        for name in ("q_norm", "k_norm"):
            tensors[f"{p}self_attn.{name}.weight"] = torch.ones(head_dim).bfloat16()
    return tensors


def _llama_tools() -> Path:
    found = subprocess.run(["bash", str(PEERS / "llama-server.sh")], capture_output=True, text=True, check=True)
    return Path(found.stdout.strip().splitlines()[-1]).parent


def _converter() -> Path:
    """llama.cpp's convert_hf_to_gguf.py, from the source tree the peer script built."""
    root = _llama_tools()
    for parent in root.parents:
        hits = sorted(parent.glob("**/convert_hf_to_gguf.py"))
        if hits:
            return hits[0]
    raise RuntimeError(f"convert_hf_to_gguf.py not found above {root}")


def write_gguf(name: str, qtype: str) -> Path:
    """``folder/model-<qtype>.gguf``: the F32 GGUF by llama.cpp's converter, other types by ``llama-quantize``."""
    folder = write_model(name)
    target = folder / f"model-{qtype}.gguf"
    if target.is_file():
        return target
    f32 = folder / "model-F32.gguf"
    if not f32.is_file():
        tmp = f32.with_suffix(".tmp")
        subprocess.run([sys.executable, str(_converter()), str(folder), "--outtype", "f32", "--outfile", str(tmp)],
                       check=True)  # fmt: skip
        tmp.rename(f32)
    if qtype != "F32":
        tmp = target.with_suffix(".tmp")
        subprocess.run([str(_llama_tools() / "llama-quantize"), str(f32), str(tmp), qtype], check=True)
        tmp.rename(target)
    return target


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("--gguf", default="", help="comma-separated GGUF types to make with llama.cpp, e.g. Q8_0,Q4_K_M")
    args = p.parse_args(argv)
    print(write_model(args.shape))
    for qtype in filter(None, args.gguf.split(",")):
        print(write_gguf(args.shape, qtype))


if __name__ == "__main__":
    main()
