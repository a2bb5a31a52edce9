"""Which layers' int8 activations cost a GGUF served in blocks its greedy agreement with its float32 run.

Serves the blocks as usual (``--quantization auto``, float32 activations) except that the chosen linear layers
multiply in float32 by their dequantized blocks, in every step or only in decode or prefill steps, and prints the
agreement with the float32 run of the same blocks as ``bench.quant_agreement`` measures it (the share of prompts
whose tokens all agree, the mean share of tokens before the first difference). Layers are chosen by a part of
their module name (``lm_head``, ``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``) or ``all``.

    python -m bench.quant_attribution --exact lm_head --exact qkv_proj,o_proj --prompts 512
    python -m bench.quant_attribution --exact all --phase decode
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from types import MethodType

import torch
import torch.nn.functional as F
from torch import nn

from bench.common import format_table
from bench.quant_agreement import agreement, ours, prompts
from radixserve.runtime.attention.base import ForwardContext
from radixserve.runtime.model_source import resolve_model
from radixserve.runtime.models import quant
from radixserve.runtime.models.linear import Linear
from radixserve.runtime.weights import load_tokenizer


def make_exact(model: nn.Module, names: list[str], phase: str) -> int:
    """Route the chosen quantized layers of ``model`` through float32 products of their dequantized blocks (in
    steps of ``phase``: ``decode``, ``prefill`` or ``any``). Returns how many layers were chosen."""
    step = {"phase": ""}
    run_model = model.forward

    def forward(self: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        step["phase"] = "prefill" if ctx.meta.extends else "decode"  # a mixed step counts as prefill
        return run_model(input_ids, positions, ctx)

    model.forward = MethodType(forward, model)
    chosen = 0
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or module.qtype is None:
            continue
        if "all" not in names and not any(n in name for n in names):
            continue
        w = module.quant
        parts = w.parts if isinstance(w, quant.QuantParts) else [w]
        dense = torch.cat([p.dequantize() for p in parts])
        kernel = module.forward

        def exact(
            self: Linear, x: torch.Tensor, dense: torch.Tensor = dense, kernel: Callable[..., torch.Tensor] = kernel
        ) -> torch.Tensor:
            if phase != "any" and step["phase"] != phase:
                return kernel(x)
            return F.linear(x.float(), dense, None if self.bias is None else self.bias.float()).to(x.dtype)

        module.forward = MethodType(exact, module)
        chosen += 1
    return chosen


def exact_or_exit(model: nn.Module, names: list[str], phase: str) -> None:
    if names and not make_exact(model, names, phase):
        raise SystemExit(f"no quantized layer matches {names}")


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--exact", action="append", default=[], help="layers (comma-separated) in float32; repeatable")
    p.add_argument("--phase", choices=["any", "decode", "prefill"], default="any")
    args = p.parse_args(argv)
    os.environ["RADIXSERVE_DECODE_STACK"] = "0"  # layer by layer in Python, so that each layer's call is seen
    ids = prompts(load_tokenizer(resolve_model(args.model)), args.prompts)
    reference = ours(args.model, "none", ids, args.tokens)
    rows = []
    for choice in ["", *args.exact]:
        names = [n for n in choice.split(",") if n]
        got = ours(args.model, "auto", ids, args.tokens, lambda m, names=names: exact_or_exit(m, names, args.phase))
        rows.append([", ".join(names) or "none (as served)", *agreement(got, reference)])
    print(f"# greedy agreement with the float32 run, {args.prompts} prompts x {args.tokens} tokens, {args.model}, "
          f"float32 layers in {args.phase} steps")  # fmt: skip
    print(format_table(["layers in float32", "prompts identical", "mean share before first difference"], rows))


if __name__ == "__main__":
    main()
