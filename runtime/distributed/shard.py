"""Megatron-style tensor parallelism applied to the model before its weights are loaded, gpt-fast style: the model
code stays plain.

``shard_model`` cuts a full ``LlamaForCausalLM``, built on the meta device, down to one rank's shard in place, and
returns the function that cuts each checkpoint tensor to that shard as it is read (``ShardCuts``): a rank never
holds more of the full model than the one tensor in flight, so its memory at load is about its shard's.
  * the merged q/k/v and gate/up projections are column-parallel (each rank keeps its heads / its slice of the MLP
    width, cut from each projection separately);
  * o and down projections are row-parallel, followed by one all-reduce each (a forward hook), so every rank ends
    each layer with the full hidden state;
  * a mixture of experts keeps its router whole and splits every expert as the dense MLP is split, with one
    all-reduce after the whole block instead of one per expert;
  * the embedding and the vocabulary projection are split by vocabulary rows (padded to equal shards): the
    embedding all-reduces its partial lookups; ``compute_logits`` returns this rank's logit columns, which the
    leader gathers.

Invariants: hidden states are identical on every rank after each layer; rank ``r`` holds query heads
``[r*H/N, (r+1)*H/N)`` and KV heads ``[r*Hkv/N, (r+1)*Hkv/N)``, so grouped-query attention pairs the same heads as
the full model; a row-parallel bias is added once (rank 0 keeps it, the others hold zeros).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from radixserve.runtime.models.linear import Linear
from radixserve.runtime.models.llama import LlamaForCausalLM, MergedLinear, ModelArgs, SparseMoE
from radixserve.runtime.safetensors_read import Cut


def check_shardable(args: ModelArgs, world: int) -> None:
    """Raise ``ValueError`` saying what to change when ``args`` cannot be split over ``world`` ranks."""
    if world < 1:
        raise ValueError(f"--tp must be >= 1, got {world}")
    sizes = [
        ("attention heads", args.num_heads),
        ("key/value heads", args.num_kv_heads),
        ("MLP width (intermediate_size)", args.intermediate_size),
    ]
    if args.moe_layers:
        sizes.append(("expert MLP width (moe_intermediate_size)", args.moe_intermediate_size))
    for what, n in sizes:
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


def _meta(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A meta tensor of ``shape`` like ``t``. The loader shards the model on the meta device, before any weight
    exists, and there only shapes matter: cat, clone or a slice assignment of meta tensors run through PyTorch's
    Python decompositions, whose first use imports its compiler stack (torch._dynamo and Triton, ~125 MiB resident
    in every rank: ``bench.weights_memory --tp 2``)."""
    return torch.empty(shape, dtype=t.dtype, device="meta")


def _rows(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    if t.is_meta:
        return _meta(t, (t.shape[0] // world, *t.shape[1:]))
    return t.chunk(world, dim=0)[rank].clone()


def _cat_rows(pieces: list[torch.Tensor]) -> torch.Tensor:
    if pieces[0].is_meta:
        return _meta(pieces[0], (sum(p.shape[0] for p in pieces), *pieces[0].shape[1:]))
    return torch.cat(pieces)


def _colwise(linear: MergedLinear, rank: int, world: int) -> None:
    """Column-parallel for a merged projection: this rank's rows of each part (its q, k and v heads; its slice of
    gate and of up), concatenated in the parts' order."""
    pieces = [linear.part_rows(name) for name in linear.parts]
    linear.weight = nn.Parameter(
        _cat_rows([_rows(linear.weight.data[rows], rank, world) for rows in pieces]), requires_grad=False
    )
    if linear.bias is not None:
        linear.bias = nn.Parameter(
            _cat_rows([_rows(linear.bias.data[rows], rank, world) for rows in pieces]), requires_grad=False
        )
    linear.parts = {name: size // world for name, size in linear.parts.items()}
    linear.out_features //= world


def _rowwise(linear: nn.Linear, rank: int, world: int, group: Any) -> None:
    """Row-parallel: this rank's slice of the inputs; the partial outputs are summed by an all-reduce after the
    layer, or, with ``group`` None, after the module that owns it (the experts of a ``SparseMoE``)."""
    w = linear.weight.data
    cut = _meta(w, (w.shape[0], w.shape[1] // world)) if w.is_meta else w.chunk(world, dim=1)[rank].clone()
    linear.weight = nn.Parameter(cut, requires_grad=False)
    if linear.bias is not None and rank != 0:
        b = linear.bias.data
        linear.bias = nn.Parameter(_meta(b, tuple(b.shape)) if b.is_meta else torch.zeros_like(b), requires_grad=False)
    linear.in_features //= world
    if group is not None:
        _all_reduce_output(linear, group)


def _all_reduce_output(module: nn.Module, group: Any) -> None:
    def reduce(_module: nn.Module, _inputs: Any, out: torch.Tensor) -> None:
        dist.all_reduce(out, group=group)

    module.register_forward_hook(reduce)


def _vocab_rows(weight: torch.Tensor, rank: int, world: int) -> tuple[torch.Tensor, int]:
    vocab = weight.shape[0]
    start, end, size = vocab_shard(vocab, rank, world)
    if weight.is_meta:
        return _meta(weight, (size, weight.shape[1])), start
    shard = weight.new_zeros((size, weight.shape[1]))
    shard[: end - start] = weight[start:end]
    return shard, start


def _share(n: int, rank: int, world: int) -> tuple[int, int]:
    """Rank ``rank``'s range of ``n`` (divisible by ``world``; ``check_shardable``), as ``chunk`` cuts it."""
    size = n // world
    return rank * size, (rank + 1) * size


class ShardCuts:
    """Checkpoint tensor name (the decoder's) -> this rank's piece of it, the same cut ``shard_model`` made of the
    parameter; a name it does not know (norms, a single-process model) passes whole.

    Each cut is a ``Cut`` of the tensor's shape (``regions``), applied one of two ways: ``select`` tells the
    safetensors reader which bytes to read (the rank never holds the whole tensor, nor frees the rest of it, which
    left holes in its heap), and ``cut`` / ``__call__`` take it from a whole tensor (a GGUF checkpoint's). A tensor
    ``select`` already cut passes ``__call__`` as it is."""

    def __init__(self) -> None:
        self.regions: dict[str, Callable[[list[int]], Cut | None]] = {}
        self._read_cut: set[str] = set()  # names the reader cut (select), not cut again

    def __call__(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name in self._read_cut:
            self._read_cut.discard(name)
            return tensor
        region = self.regions.get(name)
        cut = region(list(tensor.shape)) if region is not None else None
        return tensor if cut is None else cut.take(tensor)

    def cut(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        for name, tensor in weights:
            yield name, self(name, tensor)

    def select(self, name: str, shape: list[int]) -> Cut | None:
        """The part of the checkpoint tensor ``name`` (of ``shape``) this rank reads, or None for all of it."""
        region = self.regions.get(name)
        found = region(shape) if region is not None else None
        if found is not None:
            self._read_cut.add(name)
        return found

    def colwise(self, owner: str, name: str, linear: MergedLinear, rank: int, world: int) -> None:
        """A merged projection's parts (q/k/v, gate/up) are cut by rows, each on its own; a checkpoint that holds
        the merged tensor whole (Phi-3) is cut piece by piece. Call it before the projection itself is sharded
        (its ``parts`` are still the full sizes)."""
        full = list(linear.parts.values())
        starts = [sum(full[:i]) for i in range(len(full))]
        fused = Cut(rows=tuple((s + a, s + b) for s, n in zip(starts, full) for a, b in [_share(n, rank, world)]))
        for leaf in ("weight", "bias"):
            for part in linear.parts:
                self.regions[f"{owner}.{part}.{leaf}"] = lambda shape: Cut(rows=(_share(shape[0], rank, world),))
            self.regions[f"{name}.{leaf}"] = lambda shape, fused=fused: fused

    def rowwise(self, name: str, rank: int, world: int) -> None:
        self.regions[f"{name}.weight"] = lambda shape: Cut(rows=((0, shape[0]),), cols=_share(shape[1], rank, world))
        if rank != 0:  # the bias is added once, by rank 0: the others read nothing and hold zeros
            self.regions[f"{name}.bias"] = lambda shape: Cut(rows=(), out_rows=shape[0])

    def vocab(self, name: str, rank: int, world: int) -> None:
        def region(shape: list[int]) -> Cut:
            start, end, size = vocab_shard(shape[0], rank, world)
            return Cut(rows=((start, end),), out_rows=size)

        self.regions[name] = region


def shard_model(model: LlamaForCausalLM, rank: int, world: int, group: Any) -> ShardCuts:
    """Turn the full ``model`` into rank ``rank``'s shard of ``world`` (in place; see the module docstring) and
    return the cuts its checkpoint tensors need. Shard a model built on the meta device, before loading: the
    weights' data is not cut here, and a packed copy made of a full weight would be stale."""
    args = model.args
    check_shardable(args, world)
    cuts = ShardCuts()
    if world == 1:
        return cuts
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}"
        attn = layer.self_attn
        cuts.colwise(f"{prefix}.self_attn", f"{prefix}.self_attn.qkv_proj", attn.qkv_proj, rank, world)
        _colwise(attn.qkv_proj, rank, world)
        cuts.rowwise(f"{prefix}.self_attn.o_proj", rank, world)
        _rowwise(attn.o_proj, rank, world, group)
        attn.num_heads //= world
        attn.num_kv_heads //= world
        mlp = layer.mlp
        if isinstance(mlp, SparseMoE):
            # Every rank routes every token (the router is whole) and runs its slice of each expert hit; the
            # weighted partial sums of all experts are all-reduced once, after the block.
            for e, expert in enumerate(mlp.experts):
                name = f"{prefix}.mlp.experts.{e}"
                cuts.colwise(name, f"{name}.gate_up_proj", expert.gate_up_proj, rank, world)
                _colwise(expert.gate_up_proj, rank, world)
                cuts.rowwise(f"{name}.down_proj", rank, world)
                _rowwise(expert.down_proj, rank, world, None)
            _all_reduce_output(mlp, group)
            continue
        cuts.colwise(f"{prefix}.mlp", f"{prefix}.mlp.gate_up_proj", mlp.gate_up_proj, rank, world)
        _colwise(mlp.gate_up_proj, rank, world)
        cuts.rowwise(f"{prefix}.mlp.down_proj", rank, world)
        _rowwise(mlp.down_proj, rank, world, group)
    cuts.vocab("model.embed_tokens.weight", rank, world)
    cuts.vocab("lm_head.weight", rank, world)
    embed_rows, start = _vocab_rows(model.model.embed_tokens.weight.data, rank, world)
    model.model.embed_tokens = VocabParallelEmbedding(embed_rows, start, group)
    head = Linear(args.hidden_size, embed_rows.shape[0], bias=False, device=embed_rows.device)
    if args.tie_word_embeddings:
        head.weight = model.model.embed_tokens.weight
    else:
        head.weight = nn.Parameter(_vocab_rows(model.lm_head.weight.data, rank, world)[0], requires_grad=False)
    model.lm_head = head
    return cuts
