"""The pure-PyTorch reference attention backend. Runs anywhere torch runs (CPU and CUDA).

Decode tokens are attended together over one padded gather of their KV slots; when several decoding sequences
share a cached prefix, that prefix is attended once against a single copy of its K/V and merged with each row's
own suffix by log-sum-exp (cascade attention), so a 1,000-token system prompt shared by 64 requests is read once
per layer rather than 64 times. Prefill chunks go one sequence at a time (few per step and long). Layers with
``AttnOptions`` (a sliding window, a scale, soft-capping) take the masked path of ``masked``.

Decode is the hot loop of serving, so its per-step work (gather indices, the padding mask) is done once per
forward pass in ``prepare``. Per layer, one ``index_select`` gathers the rows' keys into a reused workspace,
already in the ``[rows * kv_heads, tokens, head_dim]`` layout that one ``bmm`` reads in place, and
``embedding_bag`` sums the values weighted by the probabilities straight from the pool. On CPU in float32 the
compiled kernel of ``cpu_kernels`` does a decode row's whole attention reading the pool in place instead, in
float32 and bfloat16 (opt in with ``cpu_kernels=True``; the engine does for CPU models); the PyTorch ops stay the
reference. The kernel takes whole rows (shared prefix put back in front, see ``slot_rows.full_rows``): reading
the prefix in place beat the PyTorch cascade's gather and merges on CPU. In bfloat16 on a CPU with AVX-512 BF16 it
is also told each row's group (``slot_rows.group_table``) and attends a group's shared prefix once for all its rows,
on ``vdpbf16ps``, merged with each row's own keys (``prefix_groups_op``; not with ``deterministic``, where a row's
result must not depend on which other rows share its step). In bfloat16
on a CPU with AVX-512 BF16 and no AMX, every long prefill chunk of a step goes to ``cpu_kernels``' prefill kernel
in one call instead of SDPA, its cached prefix read in place (no gather, no mask).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from radixserve.runtime.attention import cpu_kernels, slot_rows
from radixserve.runtime.attention.base import (
    PLAIN,
    AttentionBackend,
    AttentionMetadata,
    AttnOptions,
    KernelRows,
    PrefixGroup,
)
from radixserve.runtime.attention.cpu_kernels import (
    DecodeAttention,
    ExtendAttention,
    decode_attention_op,
    extend_attention_op,
    prefix_groups_op,
)
from radixserve.runtime.attention.masked import masked_attention
from radixserve.runtime.kv_pool import KVPool

# Gather workspaces up to this size are kept between layers and steps (a fresh multi-MB tensor per layer costs
# page faults on every use); larger ones, rare, are allocated per call.
MAX_WORKSPACE_BYTES = 512 * 2**20
# Spare room when the workspace grows: decode rows get one token longer every step.
WORKSPACE_GROWTH = 1.25
# Chunks of at most this many tokens after a cached prefix attend on the decode kernel, a query per row: a
# speculative verification or a jump-forward would otherwise gather the whole prefix in every layer.
SHORT_EXTEND = 16


@dataclass
class _DecodeLayout:
    slots: torch.Tensor  # [B, L] each row's slots, padded
    lens: torch.Tensor  # [B] int64, each row's real length
    width: int  # L, the padded row length
    prefix_index: tuple[torch.Tensor, ...]  # per prefix group, ``slot_rows.kv_rows`` of its prefix slots
    # For the compiled kernel: each row's (prefix group or -1, prefix length), where it attends groups together.
    groups: torch.Tensor | None
    # For the PyTorch path only (None when the compiled kernel attends):
    key_index: torch.Tensor | None  # [B * Hkv * L] rows of kv[0].view(-1, D): each row's keys, head by head, padded
    bias: torch.Tensor | None  # [B * Hkv, 1, L] float32: 0 where a real token sits, -inf on padding
    # Value rows per (row, head, query head) for ``embedding_bag``; made by the first layer (it needs G).
    value_index: torch.Tensor | None = None
    bag_offsets: torch.Tensor | None = None


@dataclass
class _StepState:
    decode: _DecodeLayout | None
    extend_index: tuple[torch.Tensor | None, ...]  # per extend with a cached prefix, ``slot_rows.kv_rows`` of its slots
    whole_rows: tuple[torch.Tensor, torch.Tensor] | None = None  # for layers with options (``masked``)
    # Per extend: (slot table, lengths) when its queries run as decode rows of the kernel (``SHORT_EXTEND``).
    short_extends: tuple[tuple[torch.Tensor, torch.Tensor] | None, ...] = ()
    windowed: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # per window: rows' tails
    # The chunks the bfloat16 prefill kernel attends, in one call: (slots, seqs) as ``ExtendAttention`` takes them
    # (a row of seqs per chunk); None when no chunk goes to it.
    kernel_extends: tuple[torch.Tensor, torch.Tensor] | None = None


def _scores(q: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * q @ keys^T`` in float32, for a half-precision ``q`` [N, G, D] and ``keys`` [N, L, D].

    q is scaled before the product (as SDPA does), and half-precision products are taken in float32: an unscaled
    float16 q.k overflows its range (65,504) long before the scaled score does, and a score rounded to bfloat16 (a
    step of 0.125 near 16) moves probabilities by up to ~6%: 4-8x the kernels' error, in the path they are
    checked against."""
    if q.dtype != torch.float32:
        return torch.bmm(q.float() * scale, keys.float().transpose(1, 2))
    return torch.bmm(q * scale, keys.transpose(1, 2))


class TorchReferenceBackend(AttentionBackend):
    """``cpu_kernels=True`` runs float32 / bfloat16 CPU decode attention on the compiled kernel when it builds on this
    machine (see ``runtime.attention.cpu_kernels``; the first use on a machine compiles it, ~20 s).

    ``deterministic=True`` (``--enable-deterministic-inference``) attends every query of a prefill chunk as a
    kernel decode row too, so each token's attention is one fixed computation over its query and the keys up to
    it, whatever chunk, batch or cached prefix it comes with. SDPA's blocking depends on the chunk's lengths: the
    same token prefilled whole or after a cached prefix differs in the last bits (2e-7), and over GGUF blocks the
    kernel's int8 rounding of the activations can turn that into a different greedy token (a prompt with its first
    half cached: 7 of 12 64-token continuations differed, float32). Costs prefill speed on long chunks."""

    def __init__(self, cpu_kernels: bool = False, deterministic: bool = False) -> None:
        self._workspace: torch.Tensor | None = None
        self._decode_kernel: DecodeAttention | None = decode_attention_op() if cpu_kernels or deterministic else None
        self._extend_kernel: ExtendAttention | None = extend_attention_op() if cpu_kernels else None
        # Rows that share a prefix attend it together on the kernel, except when deterministic: a row's result
        # must not depend on which other rows share its step.
        self._grouped_kernel = prefix_groups_op() if cpu_kernels and not deterministic else None
        if deterministic and self._decode_kernel is None:
            raise ValueError(
                "--enable-deterministic-inference needs the compiled CPU attention kernel, which did not build on "
                "this machine (see the log); run without it"
            )
        self.deterministic = deterministic

    def prepare(self, meta: AttentionMetadata, pool: KVPool) -> _StepState:
        decode = None
        if meta.num_decode:
            assert meta.decode_slots is not None
            b, width = meta.decode_slots.shape
            row_lens = meta.lens()
            assert row_lens is not None
            pool_tensor = pool.kv[0]
            if self._decode_kernel is not None and cpu_kernels.applies(pool_tensor.device, pool_tensor.dtype):
                slots, lens = slot_rows.full_rows(meta.decode_slots, row_lens, meta.prefix_groups)
                together = self._grouped_kernel is not None and pool_tensor.dtype == torch.bfloat16
                table = slot_rows.group_table(b, meta.prefix_groups) if together and meta.prefix_groups else None
                decode = _DecodeLayout(slots, lens, slots.shape[1], (), table, None, None)
            else:
                mask = meta.mask()
                assert mask is not None
                real = mask.reshape(b, width)
                prefixes = tuple(slot_rows.kv_rows(g.prefix_slots, pool) for g in meta.prefix_groups)
                bias = torch.zeros(b, width, dtype=torch.float32, device=real.device).masked_fill_(~real, float("-inf"))
                n_kv = pool.num_kv_heads
                bias = bias[:, None, None, :].expand(b, n_kv, 1, width).reshape(b * n_kv, 1, width)
                heads = torch.arange(n_kv, device=real.device) * pool.slot_rows
                keys = (meta.decode_slots[:, None, :] + heads[None, :, None]).reshape(-1)
                decode = _DecodeLayout(meta.decode_slots, row_lens, width, prefixes, None, keys, bias)
        kernel = self._decode_kernel is not None and cpu_kernels.applies(pool.kv[0].device, pool.kv[0].dtype)
        bf16_kernel = (
            self._extend_kernel is not None
            and pool.kv[0].dtype == torch.bfloat16
            and pool.head_dim in cpu_kernels.EXTEND_HEAD_DIMS
            and kernel
        )
        extends: list[torch.Tensor | None] = []
        short: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        chunk_slots: list[torch.Tensor] = []
        chunk_rows: list[tuple[int, int, int, int]] = []
        offset = 0
        for seq in meta.extends:
            slots = seq.kv_slots
            if slots is None and self.deterministic:  # a fresh sequence: its keys are the chunk's own slots
                slots = meta.out_slots[seq.q_start : seq.q_start + seq.q_len]
            as_rows = kernel and slots is not None and (self.deterministic or seq.q_len <= SHORT_EXTEND)
            # A short chunk after a cached prefix (a speculative verification, a jump-forward's forced tokens): each
            # query is a decode row of the kernel over the prefix up to itself, read in place (no gather).
            short.append(slot_rows.query_rows(slots, seq.q_len) if as_rows else None)  # type: ignore[arg-type]
            if bf16_kernel and not as_rows:  # the prefill kernel reads the chunk's keys in place, prefix and all
                own = meta.out_slots[seq.q_start : seq.q_start + seq.q_len]
                chunk_slots.append(own if seq.kv_slots is None else seq.kv_slots)
                chunk_rows.append((seq.q_start, seq.q_len, seq.kv_len, offset))
                offset += seq.kv_len
                extends.append(None)
                continue
            extends.append(None if seq.kv_slots is None or as_rows else slot_rows.kv_rows(seq.kv_slots, pool))
        in_kernel = None
        if chunk_rows:
            table = torch.tensor(chunk_rows, dtype=torch.int64)
            in_kernel = (torch.cat(chunk_slots), table)
        return _StepState(decode, tuple(extends), short_extends=tuple(short), kernel_extends=in_kernel)

    def kernel_decode_rows(self, meta: AttentionMetadata, state: _StepState) -> KernelRows | None:
        decode = state.decode
        if meta.extends or decode is None or decode.key_index is not None or self._decode_kernel is None:
            return None
        return decode.slots, decode.lens, decode.groups

    def _gather(self, kv: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``kv.view(-1, D)[index]``, into the reused workspace when it is small enough."""
        flat = kv.view(-1, kv.shape[-1])
        n, d = index.numel(), flat.shape[1]
        if n * d * flat.element_size() > MAX_WORKSPACE_BYTES:
            return flat.index_select(0, index)
        ws = self._workspace
        if ws is None or ws.shape[0] < n or ws.dtype != flat.dtype or ws.device != flat.device or ws.shape[1] != d:
            cap = min(int(n * WORKSPACE_GROWTH), MAX_WORKSPACE_BYTES // (d * flat.element_size()))
            ws = self._workspace = torch.empty(max(n, cap), d, dtype=flat.dtype, device=flat.device)
        return torch.index_select(flat, 0, index, out=ws[:n])

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        pool: KVPool,
        state: _StepState | None = None,
        options: AttnOptions = PLAIN,
    ) -> torch.Tensor:
        if state is None:
            state = self.prepare(meta, pool)
        pool.store(layer, meta.out_slots, k, v)
        kv = pool.kv[layer]  # [2, Hkv, N, D]
        if not options.plain:
            return self._with_options(q, k, v, kv, meta, state, options)
        nd = meta.num_decode
        decoded = None
        if state.decode is not None:
            decoded = self._decode(q[:nd], kv, state.decode, meta.prefix_groups)
            if not meta.extends:
                return decoded
        n_kv, d = kv.shape[1], kv.shape[3]
        in_kernel = state.kernel_extends
        if in_kernel is not None:
            assert self._extend_kernel is not None
            out = self._extend_kernel(q.contiguous(), kv, in_kernel[0], in_kernel[1], d**-0.5, 0)
        else:
            out = torch.empty_like(q)
        if decoded is not None:
            out[:nd] = decoded
        for seq, index, short in zip(meta.extends, state.extend_index, state.short_extends, strict=True):
            s, e = seq.q_start, seq.q_start + seq.q_len
            if in_kernel is not None and short is None:
                continue  # attended above
            if short is not None:
                assert self._decode_kernel is not None
                out[s:e] = self._decode_kernel(q[s:e].contiguous(), kv, short[0], short[1], d**-0.5)[0]
                continue
            qs = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
            if index is None:
                ks = k[s:e].transpose(0, 1).unsqueeze(0)
                vs = v[s:e].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            else:
                rows = self._gather(kv, index).view(2, 1, n_kv, seq.kv_len, d)
                # Query i sits at absolute position kv_len - q_len + i and sees keys up to there.
                mask = torch.ones(seq.q_len, seq.kv_len, dtype=torch.bool, device=q.device).tril(
                    seq.kv_len - seq.q_len
                )
                o = F.scaled_dot_product_attention(qs, rows[0], rows[1], attn_mask=mask, enable_gqa=True)
            out[s:e] = o.squeeze(0).transpose(0, 1)
        return out

    def _with_options(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: torch.Tensor,
        meta: AttentionMetadata,
        state: _StepState,
        options: AttnOptions,
    ) -> torch.Tensor:
        """A layer with a window or a scale (no soft-capping) decodes on the compiled kernel over each row's last
        ``window`` slots, and so do the queries of its prefill chunks when deterministic; in bfloat16 its chunks
        go to the prefill kernel (window and scale included) when every chunk of the step does; everything else
        goes through ``masked``."""
        kernel = self._decode_kernel
        usable = options.softcap is None and kernel is not None and cpu_kernels.applies(kv.device, kv.dtype)
        as_rows = usable and self.deterministic  # (``prepare`` made every chunk's query rows)
        in_kernel = state.kernel_extends
        every_chunk = in_kernel is not None and in_kernel[1].shape[0] == len(meta.extends)
        if usable and meta.extends and every_chunk:  # all of the step's chunks on the prefill kernel
            assert in_kernel is not None
            assert self._extend_kernel is not None
            d = q.shape[-1]
            scale = options.scale if options.scale is not None else d**-0.5
            out = self._extend_kernel(q.contiguous(), kv, in_kernel[0], in_kernel[1], scale, options.window or 0)
            if meta.num_decode:
                out[: meta.num_decode] = self._with_options(q, k, v, kv, replace(meta, extends=()), state, options)
            return out
        if not usable or not (meta.num_decode or as_rows):
            return masked_attention(q, k, v, kv, meta, self._whole_rows(meta, state), options)
        assert kernel is not None
        nd, d = meta.num_decode, q.shape[-1]
        scale = options.scale if options.scale is not None else d**-0.5
        decoded = None
        if nd:
            slots, lens = self._whole_rows(meta, state) or (None, None)
            assert slots is not None and lens is not None
            if options.window is not None:
                slots, lens = state.windowed.get(options.window) or slot_rows.windowed(slots, lens, options.window)
                state.windowed[options.window] = (slots, lens)
            decoded = kernel(q[:nd].contiguous(), kv, slots, lens, scale)[0]
            if not meta.extends:
                return decoded
        out = torch.empty_like(q) if as_rows else masked_attention(q, k, v, kv, meta, None, options)
        if decoded is not None:
            out[:nd] = decoded
        if as_rows:
            for seq, rows in zip(meta.extends, state.short_extends, strict=True):
                assert rows is not None
                table, lens = rows
                if options.window is not None:  # (per query: each one's window starts elsewhere)
                    table, lens = slot_rows.windowed(table.expand(lens.shape[0], -1), lens, options.window)
                s, e = seq.q_start, seq.q_start + seq.q_len
                out[s:e] = kernel(q[s:e].contiguous(), kv, table, lens, scale)[0]
        return out

    def _whole_rows(self, meta: AttentionMetadata, state: _StepState) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The decode rows' slot tables with any shared prefix in front (made once per step, for the layers with
        options)."""
        if not meta.num_decode:
            return None
        if state.whole_rows is None:
            lens = meta.lens()
            assert meta.decode_slots is not None and lens is not None
            state.whole_rows = slot_rows.full_rows(meta.decode_slots, lens, meta.prefix_groups)
        return state.whole_rows

    def _decode(
        self, q: torch.Tensor, kv: torch.Tensor, layout: _DecodeLayout, groups: tuple[PrefixGroup, ...]
    ) -> torch.Tensor:
        """One query per sequence ([B, H, D]). The G query heads that share a KV head become G query rows against
        that head, so grouped-query attention needs no repeated K/V, and the batch of ``bmm`` is (row, kv head)."""
        b, h, d = q.shape
        n_kv = kv.shape[1]
        g = h // n_kv
        qh = q.reshape(b * n_kv, g, d)
        if layout.key_index is None:  # ``prepare`` chose the compiled kernel, over whole rows (see slot_rows.full_rows)
            assert self._decode_kernel is not None
            return self._decode_kernel(q.contiguous(), kv, layout.slots, layout.lens, d**-0.5, layout.groups)[0]
        keys = self._gather(kv[0], layout.key_index).view(b * n_kv, layout.width, d)
        scale = d**-0.5
        if q.dtype == torch.float32:
            # scale * q.k + mask in one op; the scale (a power of two for usual head sizes) and the 0/-inf mask
            # give the same values as scaling and masking after the matmul.
            scores = torch.baddbmm(layout.bias, qh, keys.transpose(1, 2), alpha=scale)
        else:
            scores = _scores(qh, keys, scale) + layout.bias
        if not groups:
            return self._weighted_values(torch.softmax(scores, dim=-1), kv, layout).view(b, h, d)
        m = scores.amax(dim=-1, keepdim=True)
        e = torch.exp(scores - m)
        den = e.sum(dim=-1, keepdim=True).view(b, n_kv, g, 1)
        num = self._weighted_values(e, kv, layout).float().view(b, n_kv, g, d)
        return self._cascade(m.view(b, n_kv, g, 1), den, num, qh, kv, layout, groups).view(b, h, d)

    def _weighted_values(self, weights: torch.Tensor, kv: torch.Tensor, layout: _DecodeLayout) -> torch.Tensor:
        """``weights`` [B * Hkv, G, L] (float32) times each row's values: ``[B * Hkv, G, D]`` in the pool's dtype.

        In float32 the values are never gathered: ``embedding_bag`` sums each bag of value rows, weighted, straight
        from the pool, which saves writing and re-reading a copy (a third less memory traffic for decode)."""
        n_kv, n_slots, d = kv.shape[1], kv.shape[2], kv.shape[3]
        rows, g, width = weights.shape
        values = kv[1].view(n_kv * n_slots, d)
        if kv.dtype != torch.float32:
            picked = values.index_select(0, layout.key_index).view(rows, width, d)
            return torch.bmm(weights.to(kv.dtype), picked)
        if layout.value_index is None:
            # Bag (row, kv head, query head) = that row's value rows of that head; the G query heads repeat them.
            index = layout.key_index.view(rows, 1, width).expand(rows, g, width).reshape(-1)
            layout.value_index = index
            layout.bag_offsets = torch.arange(0, index.numel(), width, device=index.device)
        out = F.embedding_bag(
            layout.value_index, values, layout.bag_offsets, mode="sum", per_sample_weights=weights.reshape(-1)
        )
        return out.view(rows, g, d)

    def _cascade(
        self,
        m: torch.Tensor,  # [B, Hkv, G, 1] float32: the running max of each row's own (suffix) scores
        den: torch.Tensor,  # [B, Hkv, G, 1] float32: sum of exp(score - m) over the suffix
        num: torch.Tensor,  # [B, Hkv, G, D] float32: those weights times the suffix values
        qh: torch.Tensor,  # [B * Hkv, G, D]
        kv: torch.Tensor,
        layout: _DecodeLayout,
        groups: tuple[PrefixGroup, ...],
    ) -> torch.Tensor:
        """Each row's unnormalized partial result over its suffix, merged with its group's shared prefix by
        log-sum-exp; returns ``[B * Hkv, G, D]``."""
        n_kv, d = kv.shape[1], kv.shape[3]
        b, g = qh.shape[0] // n_kv, qh.shape[1]
        dtype = qh.dtype
        q4 = qh.view(b, n_kv, g, d)
        for group, index in zip(groups, layout.prefix_index, strict=True):
            nb = group.rows.shape[0]
            prefix = self._gather(kv, index).view(2, n_kv, group.prefix_slots.shape[0], d)
            qg = q4.index_select(0, group.rows).transpose(0, 1).reshape(n_kv, nb * g, d)
            sp = _scores(qg, prefix[0], d**-0.5)  # [Hkv, b*G, P]
            mp = sp.amax(dim=-1, keepdim=True)
            ep = torch.exp(sp - mp)
            denp = ep.sum(dim=-1, keepdim=True)
            nump = torch.bmm(ep.to(dtype), prefix[1]).float()  # [Hkv, b*G, D]

            def rows_first(x: torch.Tensor, nb: int = nb) -> torch.Tensor:
                return x.view(n_kv, nb, g, x.shape[-1]).transpose(0, 1)  # [b, Hkv, G, X]

            mp, denp, nump = rows_first(mp), rows_first(denp), rows_first(nump)
            mr = m.index_select(0, group.rows)
            new_m = torch.maximum(mr, mp)
            a, c = torch.exp(mr - new_m), torch.exp(mp - new_m)
            num.index_copy_(0, group.rows, num.index_select(0, group.rows) * a + nump * c)
            den.index_copy_(0, group.rows, den.index_select(0, group.rows) * a + denp * c)
            m.index_copy_(0, group.rows, new_m)
        return (num / den).to(dtype).view(b * n_kv, g, d)


def attention_backend(
    deterministic: bool, device: torch.device, dtype: torch.dtype, softcap: float | None, kind: str = "auto"
) -> AttentionBackend:
    """The backend an engine (or a tensor-parallel rank) attends with (``--attention-backend``): on CUDA the Triton
    kernels (``triton_attention``) where Triton imports, else this reference with the compiled CPU kernels where
    they apply. ``ValueError`` where ``deterministic`` (``--enable-deterministic-inference``) or the asked-for
    kind cannot hold."""
    if kind not in ("auto", "torch", "triton"):
        raise ValueError(f"--attention-backend must be auto, torch or triton, got {kind!r}")
    if kind == "triton" or (kind == "auto" and device.type == "cuda" and not deterministic):
        if device.type != "cuda":
            raise ValueError("--attention-backend triton runs on CUDA; on the CPU use auto or torch")
        try:
            from radixserve.runtime.attention.triton_attention import TritonBackend
        except ImportError:
            if kind == "triton":
                raise ValueError("--attention-backend triton needs Triton: pip install triton") from None
        else:
            return TritonBackend()
    kernels = cpu_kernels.applies(device, dtype)
    if deterministic and not kernels:
        raise ValueError(
            "--enable-deterministic-inference runs on the CPU attention kernel: use --device cpu with --dtype "
            f"float32 or bfloat16 (got {device}, {dtype})"
        )
    if deterministic and softcap is not None:
        raise ValueError(
            "--enable-deterministic-inference does not cover attention soft-capping (Gemma 2); run without it"
        )
    return TorchReferenceBackend(cpu_kernels=kernels, deterministic=deterministic)
