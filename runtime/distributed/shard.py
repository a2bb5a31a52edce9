"""Megatron-style tensor parallelism applied to a loaded model, gpt-fast style: the model code stays plain.

``shard_model`` cuts a full ``LlamaForCausalLM`` down to one rank's shard in place:
  * the merged q/k/v and gate/up projections are column-parallel (each rank keeps its heads / its slice of the MLP
    width, cut from each projection separately);
  * o and down projections are row-parallel, followed by one all-reduce each (a forward hook), so every rank ends
    each layer with the full hidden state;
  * the embedding and the vocabulary projection are split by vocabulary rows (padded to equal shards): the
    embedding all-reduces its partial lookups; ``compute_logits`` returns this rank's logit columns, which the
    leader gathers.

Invariants: hidden states are identical on every rank after each layer; rank ``r`` holds query heads
``[r*H/N, (r+1)*H/N)`` and KV heads ``[r*Hkv/N, (r+1)*Hkv/N)``, so grouped-query attention pairs the same heads as
the full model; a row-parallel bias is added once (rank 0 keeps it, the others hold zeros).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from radixserve.runtime.models.linear import Linear, prepack
from radixserve.runtime.models.llama import LlamaForCausalLM, MergedLinear, ModelArgs


def check_shardable(args: ModelArgs, world: int) -> None:
    """Raise ``ValueError`` saying what to change when ``args`` cannot be split over ``world`` ranks."""
    if world < 1:
        raise ValueError(f"--tp must be >= 1, got {world}")
    if world > 1 and args.moe_layers:
        raise ValueError(f"{args.architecture} (mixture of experts) cannot be split with --tp yet; use --tp 1")
    for what, n in (
        ("attention heads", args.num_heads),
        ("key/value heads", args.num_kv_heads),
        ("MLP width (intermediate_size)", args.intermediate_size),
    ):
        if n % world:
            divisors = [d for d in range(1, n + 1) if n % d == 0 and args.num_kv_heads % d == 0]
            raise ValueError(
                f"--tp {world} does not divide the model's {n} {what}; use a --tp that divides the attention "
                f"heads, key/value heads and MLP width, e.g. one of {divisors[:8]}"
            )


def vocab_shard(vocab_size: int, rank: int, world: int) -> tuple[int, int, int]:
    """``(start, end, shard_size)``: this rank's vocabulary rows; shards are equal, the last one padded."""
    size = -(-vocab_size // world)
    start = rank * size
    return start, min(vocab_size, start + size), size


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + shard_size)`` of the embedding; ids outside them contribute zeros, then one
    all-reduce sums the ranks' lookups into the full embedding."""

    def __init__(self, weight: torch.Tensor, start: int, group: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start = start
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        dist.all_reduce(out, group=self.group)
        return out


def _rows(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return t.chunk(world, dim=0)[rank].clone()


def _colwise(linear: MergedLinear, rank: int, world: int) -> None:
    """Column-parallel for a merged projection: this rank's rows of each part (its q, k and v heads; its slice of
    gate and of up), concatenated in the parts' order."""
    pieces = [linear.part_rows(name) for name in linear.parts]
    linear.weight = nn.Parameter(
        torch.cat([_rows(linear.weight.data[rows], rank, world) for rows in pieces]), requires_grad=False
    )
    if linear.bias is not None:
        linear.bias = nn.Parameter(
            torch.cat([_rows(linear.bias.data[rows], rank, world) for rows in pieces]), requires_grad=False
        )
    linear.parts = {name: size // world for name, size in linear.parts.items()}
    linear.out_features //= world


def _rowwise(linear: nn.Linear, rank: int, world: int, group: Any) -> None:
    linear.weight = nn.Parameter(linear.weight.data.chunk(world, dim=1)[rank].clone(), requires_grad=False)
    if linear.bias is not None and rank != 0:
        linear.bias = nn.Parameter(torch.zeros_like(linear.bias.data), requires_grad=False)
    linear.in_features //= world

    def reduce(_module: nn.Module, _inputs: Any, out: torch.Tensor) -> None:
        dist.all_reduce(out, group=group)

    linear.register_forward_hook(reduce)


def _vocab_rows(weight: torch.Tensor, rank: int, world: int) -> tuple[torch.Tensor, int]:
    vocab = weight.shape[0]
    start, end, size = vocab_shard(vocab, rank, world)
    shard = weight.new_zeros((size, weight.shape[1]))
    shard[: end - start] = weight[start:end]
    return shard, start


def shard_model(model: LlamaForCausalLM, rank: int, world: int, group: Any) -> None:
    """Turn the full ``model`` into rank ``rank``'s shard of ``world`` (in place); see the module docstring."""
    args = model.args
    check_shardable(args, world)
    if world == 1:
        return
    for layer in model.model.layers:
        attn = layer.self_attn
        _colwise(attn.qkv_proj, rank, world)
        _rowwise(attn.o_proj, rank, world, group)
        attn.num_heads //= world
        attn.num_kv_heads //= world
        mlp = layer.mlp
        _colwise(mlp.gate_up_proj, rank, world)
        _rowwise(mlp.down_proj, rank, world, group)
    embed_rows, start = _vocab_rows(model.model.embed_tokens.weight.data, rank, world)
    model.model.embed_tokens = VocabParallelEmbedding(embed_rows, start, group)
    head = Linear(args.hidden_size, embed_rows.shape[0], bias=False, device=embed_rows.device)
    if args.tie_word_embeddings:
        head.weight = model.model.embed_tokens.weight
    else:
        head.weight = nn.Parameter(_vocab_rows(model.lm_head.weight.data, rank, world)[0], requires_grad=False)
    model.lm_head = head
    prepack(model)  # the shards replaced the weights: repack them (and drop the full model's packed copies)
