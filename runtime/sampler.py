"""Batched next-token sampling: grammar mask, logit bias, penalties, then greedy or seeded sampling.

One call handles a whole decode batch, vectorized over it. Each sampled request draws one uniform number per
token from its own counter-based stream: draw ``k`` of a request with seed ``s`` is ``splitmix64(s + (k + 1) *
golden)``, computed for all rows at once on the logits' device (``counter_uniforms``; 64-bit integer ops that give
the same bits on CPU and CUDA); the token is then found for all rows at once by inverse-CDF search. So a seeded
request produces the same tokens whatever else shares its batch, whichever row it occupies and on whichever
device, and no generator state has to come back to the host.

Order of operations for a row (each step is skipped for the whole batch when no row needs it):
  1. grammar mask (disallowed tokens become -inf), then allowed_token_ids and bad_words_ids likewise;
  2. logit_bias (added), repetition_penalty (HF: over prompt + output), frequency/presence penalties
     (OpenAI: over output only), and the min_new_tokens mask on EOS / stop_token_ids;
  3. logprobs are taken here, before temperature, as OpenAI and vLLM report them;
  4. greedy rows take the argmax; sampled rows get temperature, top_k, top_p, min_p, then one draw.
top_k and top_p are thresholds on the logit value, so tokens tied with the last kept one are kept too: the
kept set then depends only on the row's values, never on how a sort orders ties.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixserve.runtime.logprobs import token_logprobs
from radixserve.runtime.request import Req, TokenLogprob
from radixserve.runtime.sampling_params import SamplingParams
from radixserve.runtime.transfer import tensor_on, to_device

# top_k / top_p first look at this many best candidates; rows whose cut lies further down get a full sort.
TOP_WINDOW = 256
_NEG_INF = float("-inf")


class NoAllowedTokenError(ValueError):
    """The grammar allows no token at all in some rows; ``rids`` names them so the engine fails only those."""

    def __init__(self, rids: list[str], by: str = "the grammar") -> None:
        super().__init__(f"no token is allowed by {by} for request(s) {', '.join(map(repr, rids))}")
        self.rids = rids


class NonFiniteLogitsError(ValueError):
    """Some rows have no finite distribution to sample from (a nan or +inf logit); ``rids`` names them."""

    def __init__(self, rids: list[str]) -> None:
        super().__init__(f"the model's scores are not finite (nan or inf) for request(s) {', '.join(map(repr, rids))}")
        self.rids = rids


@dataclass
class SampleOutput:
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprob | None]  # per row; None unless req.params.return_logprob


def _flat_positions(id_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """``row * V + id`` for every id of every row, as one tensor (ids outside the vocabulary are dropped)."""
    lengths = [len(ids) for ids in id_lists]
    ids = tensor_on(list(itertools.chain.from_iterable(id_lists)), device, torch.long)
    rows = torch.repeat_interleave(torch.arange(len(id_lists), device=device), tensor_on(lengths, device))
    valid = (ids >= 0) & (ids < vocab_size)
    return (rows * vocab_size + ids)[valid]


def _top_k_top_p_cut(
    vals: torch.Tensor, k: torch.Tensor, p: torch.Tensor, lse_row: torch.Tensor, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lowest kept logit per row, from the best ``vals`` [R, W] (sorted descending) of each row.

    ``k`` is top_k (``vocab_size`` when off), ``p`` top_p, ``lse_row`` the logsumexp of the whole row. Returns
    (threshold, complete): ``complete`` is False where the cut may lie beyond the W candidates seen.
    """
    w = vals.shape[-1]
    k_fits = k <= w
    kth = vals.gather(1, (k.clamp(max=w) - 1)[:, None]).squeeze(1)
    keep = vals >= torch.where(k_fits, kth, _NEG_INF)[:, None]
    # top_p runs on the top_k-renormalized distribution (as HF chains them), else on the whole row.
    lse = torch.where(k_fits, torch.logsumexp(vals.masked_fill(~keep, _NEG_INF), dim=-1), lse_row)
    probs = torch.exp(vals - lse[:, None]).masked_fill(~keep, 0.0)
    cum = torch.cumsum(probs, dim=-1)
    # The best token has nothing above it, so at least one token always survives.
    keep &= ((cum - probs) <= p[:, None]) | (p >= 1.0)[:, None]
    threshold = vals.gather(1, (keep.sum(dim=-1) - 1)[:, None]).squeeze(1)
    # Everything past the window is dropped when top_k fits in it, or when its mass already exceeds top_p.
    complete = k_fits | ((k >= vocab_size) & (cum[:, -1] > p))
    return threshold, complete


def _mask_disallowed(x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """In place: ``x[b, t] = -inf`` wherever ``allowed[b, t]`` is False; returns ``x``. Same result as
    ``masked_fill_(~allowed, -inf)``, which on CPU runs element by element: ~1.4 ms for 16 x 49,152 logits,
    against ~0.25 ms for adding a bias of 0 / -inf (exact, ``x + 0 == x``)."""
    inf = float("inf")
    bias = allowed.to(x.dtype).sub_(1).mul_(inf).nan_to_num_(nan=0.0, neginf=-inf)
    x.add_(bias)
    # Disallowed +inf (a tiny temperature can overflow a logit) or nan became nan: those must read -inf, while an
    # allowed nan stays nan, as with masked_fill. Rare, so on CPU the slow exact fix runs only when a nan is there;
    # on a GPU it always runs (cheap there, and asking whether a nan is there would be a host sync).
    if x.is_cuda or bool(torch.isnan(x).any()):
        x.masked_fill_(torch.isnan(x) & ~allowed, -inf)
    return x


def _filter(xs: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, top_k, top_p and min_p on float32 logits [S, V] of sampled rows; returns new logits.

    Rows whose knob is off are left bit-exact, and each row's path depends only on its own values, so a row
    behaves the same alone or next to rows that do use top_k/top_p.
    """
    dev, v = xs.device, xs.shape[-1]
    if any(p.temperature != 1.0 for p in params):
        temp = tensor_on([p.temperature for p in params], dev, torch.float32)
        xs = xs / temp[:, None]
    cut_rows = [j for j, p in enumerate(params) if 0 < p.top_k < v or p.top_p < 1.0]
    if cut_rows:
        idx = tensor_on(cut_rows, dev)
        every_row = len(cut_rows) == len(params)
        sub = xs if every_row else xs[idx]
        k = tensor_on([params[j].top_k if 0 < params[j].top_k < v else v for j in cut_rows], dev)
        p = tensor_on([params[j].top_p for j in cut_rows], dev, torch.float32)
        lse_row = torch.logsumexp(sub, dim=-1)
        vals = sub.topk(min(TOP_WINDOW, v), dim=-1).values
        threshold, complete = _top_k_top_p_cut(vals, k, p, lse_row, v)
        if dev.type == "cuda":
            # No host sync to find the rows whose cut lies past the window: every row is sorted whole (tens of
            # microseconds on a GPU) and those rows take that threshold (the same value, exactly, for the others).
            full = sub.sort(dim=-1, descending=True).values
            threshold = torch.where(complete, threshold, _top_k_top_p_cut(full, k, p, lse_row, v)[0])
        else:
            redo = (~complete).nonzero().flatten()
            if redo.numel():
                full = sub[redo].sort(dim=-1, descending=True).values
                threshold[redo] = _top_k_top_p_cut(full, k[redo], p[redo], lse_row[redo], v)[0]
        # Out of place: ``xs`` may still be the caller's tensor, whose rows also feed logprobs.
        sub = _mask_disallowed(sub.clone(), ~(sub < threshold[:, None]))
        xs = sub if every_row else xs.index_put((idx,), sub)
    if any(p.min_p > 0.0 for p in params):
        min_p = tensor_on([p.min_p for p in params], dev, torch.float32)
        # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p); log(0) = -inf leaves a row alone.
        threshold = xs.amax(dim=-1, keepdim=True) + torch.log(min_p)[:, None]
        xs = _mask_disallowed(xs.clone(), ~(xs < threshold))
    return xs


_MASK64 = (1 << 64) - 1
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _signed(v: int) -> int:
    """The int64 with the bits of the unsigned 64-bit ``v`` (torch multiplies int64 with wrap-around)."""
    v &= _MASK64
    return v - (1 << 64) if v >> 63 else v


def _shr(z: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 bits (``>>`` on int64 copies the sign bit)."""
    return (z >> n) & ((1 << (64 - n)) - 1)


def counter_uniforms(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """float64 uniforms in [0, 1): draw ``counters[i]`` of the stream ``seeds[i]`` (int64 bits of the seed),
    splitmix64 of ``seed + (counter + 1) * golden``, top 53 bits. Equal to ``uniform_at`` bit for bit."""
    z = seeds + (counters + 1) * _signed(_GOLDEN)
    z = (z ^ _shr(z, 30)) * _signed(_MIX1)
    z = (z ^ _shr(z, 27)) * _signed(_MIX2)
    z = z ^ _shr(z, 31)
    return _shr(z, 11).to(torch.float64) * 2.0**-53


def uniform_at(seed: int, counter: int) -> float:
    """``counter_uniforms`` for one draw, in Python integers (the host-side draws of speculative verification)."""
    z = (seed + (counter + 1) * _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    z ^= z >> 31
    return (z >> 11) * 2.0**-53


def _draw(xs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of logits ``xs`` [S, V] by inverse CDF at ``uniforms`` [S] in [0, 1).

    The CDF is accumulated in float64 so rounding cannot move mass between tokens; tokens of zero weight are
    flat steps of the CDF and can never be hit.
    """
    cdf = torch.cumsum(torch.softmax(xs, dim=-1), dim=-1, dtype=torch.float64)
    total = cdf[:, -1]
    # Stay strictly below the total so the search always lands on a token of non-zero weight.
    target = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)


class Sampler:
    """Turns a batch of logits into one token per request.

    Invariants:
      * a sampled row consumes exactly one uniform of its request's stream per step (``req.rng_draws`` counts
        them) and nothing else; the stream's seed is ``params.seed``, or for unseeded requests one from this
        sampler's own RNG, taken at first use. So a seeded request's tokens depend on neither batch nor row
        position nor device; a draw that fails (a row with no distribution) is not counted, so a retry redraws it;
      * greedy rows never draw;
      * no token is ever drawn from a distribution that is not one: rows the grammar fully masks raise
        ``NoAllowedTokenError``, and sampled rows with a nan or +inf logit ``NonFiniteLogitsError`` (both
        ``ValueError``: the runner then fails only them). A greedy row takes the argmax as it is, always a token id
        of the vocabulary.
    """

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int], device: torch.device, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted({int(t) for t in eos_token_ids if 0 <= int(t) < vocab_size})
        self.device = torch.device(device)
        self._rng = torch.Generator(device="cpu")
        self._rng.manual_seed(seed)
        # Each request's allowed_token_ids on the device, made at its first step (gone with the request).
        self._allowed: weakref.WeakKeyDictionary[Req, torch.Tensor] = weakref.WeakKeyDictionary()

    def _seed(self, req: Req) -> int:
        """The request's stream seed (unsigned 64-bit), taken at its first draw."""
        if req.rng_seed is None:
            seed = req.params.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._rng).item())
            req.rng_seed = seed & _MASK64
        return req.rng_seed

    def _uniform(self, req: Req) -> float:
        """The request's next draw, on the host."""
        u = uniform_at(self._seed(req), req.rng_draws)
        req.rng_draws += 1
        return u

    def _apply_penalties(self, x: torch.Tensor, reqs: Sequence[Req]) -> None:
        """In place on contiguous float32 ``x`` [B, V]: logit_bias, repetition, frequency, presence.

        Only the (row, token) pairs that occur are touched: the cost follows the number of tokens, not B * V.
        """
        dev, v = x.device, self.vocab_size
        params = [r.params for r in reqs]
        flat = x.view(-1)
        if any(p.logit_bias for p in params):
            pos, vals = [], []
            for i, p in enumerate(params):
                for tid, bias in p.logit_bias.items():
                    if 0 <= int(tid) < v:
                        pos.append(i * v + int(tid))
                        vals.append(float(bias))
            if pos:
                flat.index_add_(0, tensor_on(pos, dev), tensor_on(vals, dev))

        if any(p.repetition_penalty != 1.0 for p in params):
            lists = [r.prompt_ids + r.output_ids if r.params.repetition_penalty != 1.0 else () for r in reqs]
            pos = torch.unique(_flat_positions(lists, v, dev))
            rep = tensor_on([p.repetition_penalty for p in params], dev, torch.float32)[pos // v]
            seen = flat[pos]
            # HF semantics: a seen token's positive logit is divided by the penalty, a negative one multiplied
            flat[pos] = torch.where(seen > 0, seen / rep, seen * rep)

        if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
            lists = [
                r.output_ids if r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0 else ()
                for r in reqs
            ]
            pos, counts = torch.unique(_flat_positions(lists, v, dev), return_counts=True)
            row = pos // v
            freq = tensor_on([p.frequency_penalty for p in params], dev, torch.float32)[row]
            pres = tensor_on([p.presence_penalty for p in params], dev, torch.float32)[row]
            flat.index_add_(0, pos, -(freq * counts + pres))

    def _apply_min_new_tokens(self, x: torch.Tensor, reqs: Sequence[Req], masked: bool) -> None:
        """Mask EOS / stop ids of rows below ``min_new_tokens``.

        With a grammar mask (``masked``), a row that allows nothing but those ids keeps them: the grammar is a
        hard constraint, min_new_tokens a soft one, and failing the request would help no one.
        """
        rows, cols = [], []
        for i, r in enumerate(reqs):
            p = r.params
            if len(r.output_ids) >= p.min_new_tokens:
                continue
            ids = {int(t) for t in p.stop_token_ids if 0 <= int(t) < self.vocab_size}
            if not p.ignore_eos:  # with ignore_eos EOS never stops the request: nothing to hold off
                ids.update(self.eos_token_ids)
            rows.extend([i] * len(ids))
            cols.extend(sorted(ids))
        if not rows:
            return
        r_t, c_t = tensor_on(rows, x.device), tensor_on(cols, x.device)
        saved = x[r_t, c_t]
        x[r_t, c_t] = _NEG_INF
        if masked:
            dead = torch.isneginf(x.amax(dim=-1))  # rows left with nothing
            x[r_t, c_t] = torch.where(dead[r_t], saved, x[r_t, c_t])

    def _apply_token_filters(self, x: torch.Tensor, reqs: Sequence[Req]) -> list[str]:
        """In place on float32 ``x`` [B, V]: ``allowed_token_ids`` (every other token -inf) and ``bad_words_ids``
        (the banned tokens -inf, unless that leaves the row nothing: a grammar that allows only them decides, as
        with min_new_tokens). Returns the rids whose allowed tokens a grammar mask left no room for. One host
        sync for all the rows, and none when no row bans anything or lists allowed ids."""
        touched: list[int] = []
        bans: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # row -> (banned columns, their saved logits)
        for i, r in enumerate(reqs):
            p = r.params
            if p.allowed_token_ids:
                ids = self._allowed.get(r)
                if ids is None:
                    ids = self._allowed[r] = tensor_on(p.allowed_token_ids, x.device)
                keep = x[i, ids]  # (advanced indexing: a copy)
                x[i].fill_(_NEG_INF)
                x[i, ids] = keep
                touched.append(i)
            if p.bad_words_ids:
                out = r.output_ids
                banned = [
                    seq[-1]
                    for seq in p.bad_words_ids
                    if len(seq) == 1 or (len(seq) - 1 <= len(out) and out[len(out) - len(seq) + 1 :] == seq[:-1])
                ]
                if banned:
                    cols = tensor_on(banned, x.device)
                    bans[i] = (cols, x[i, cols])
                    x[i, cols] = _NEG_INF
                    touched.append(i)
        if not touched:
            return []
        rows = sorted(set(touched))
        dead = [rows[j] for j, d in enumerate(torch.isneginf(x[tensor_on(rows, x.device)].amax(dim=-1)).tolist()) if d]
        empty = []
        for i in dead:
            if i in bans:
                cols, saved = bans[i]
                x[i, cols] = saved
                if not reqs[i].params.allowed_token_ids or not bool(torch.isneginf(x[i].amax())):
                    continue
            empty.append(reqs[i].rid)
        return empty

    def argmax_only(self, reqs: Sequence[Req]) -> bool:
        """Whether every row's token is the argmax of its logits as they are: greedy, no grammar, no logit edits
        (bias, penalties, allowed or banned tokens, a min_new_tokens mask still on), no log-probs."""
        for r in reqs:
            p = r.params
            if (
                not p.greedy
                or r.grammar is not None
                or p.return_logprob
                or p.edits_logits
                or len(r.output_ids) < p.min_new_tokens
            ):
                return False
        return True

    def sample(self, logits: torch.Tensor, reqs: Sequence[Req], allowed: torch.Tensor | None = None) -> SampleOutput:
        """Pick one token per row of ``logits`` [B, V'] (V' >= vocab_size; padding columns are never picked).

        ``allowed`` is an optional [B, V'] bool grammar mask. Raises ``NoAllowedTokenError`` (a ValueError)
        naming the requests whose rows it masks completely.
        """
        b, v = len(reqs), self.vocab_size
        if logits.dim() != 2 or logits.shape[0] != b or logits.shape[1] < v:
            raise ValueError(f"logits of shape {tuple(logits.shape)} do not match {b} requests")
        x = logits[:, :v]
        if allowed is not None:
            allowed = allowed[:, :v].to(device=x.device, dtype=torch.bool)
            # A max over the bytes: a bool any() over [B, V] costs ~20x more on CPU.
            empty = (allowed.view(torch.uint8).amax(dim=-1) == 0).nonzero().flatten().tolist()
            if empty:
                raise NoAllowedTokenError([reqs[i].rid for i in empty])

        params = [r.params for r in reqs]
        needs_edit = any(p.edits_logits or len(r.output_ids) < p.min_new_tokens for r, p in zip(reqs, params))
        want_lp = [p.return_logprob for p in params]
        greedy = [p.greedy for p in params]

        if all(greedy) and not needs_edit and not any(want_lp):
            # Fast path: a cast to float32 is monotone, so the argmax needs no float32 copy.
            if allowed is not None:
                x = _mask_disallowed(x.clone(), allowed)
            return SampleOutput(x.argmax(dim=-1).tolist(), [None] * b)

        x = x.to(torch.float32, copy=True).contiguous()
        if allowed is not None:
            _mask_disallowed(x, allowed)
        if needs_edit:
            empty = self._apply_token_filters(x, reqs)
            if empty:
                raise NoAllowedTokenError(empty, "the grammar and allowed_token_ids")
            self._apply_penalties(x, reqs)
            # allowed_token_ids, like a grammar, is a hard constraint: min_new_tokens yields to it.
            hard = allowed is not None or any(p.allowed_token_ids for p in params)
            self._apply_min_new_tokens(x, reqs, masked=hard)

        tokens = x.argmax(dim=-1) if any(greedy) else torch.zeros(b, dtype=torch.long, device=x.device)
        sampled = [i for i in range(b) if not greedy[i]]
        if sampled:
            idx = tensor_on(sampled, x.device)
            xs = _filter(x if len(sampled) == b else x[idx], [params[i] for i in sampled])
            # A nan or +inf row has no distribution: its draw means nothing. The check is read with the tokens (one
            # transfer); such a row raises and its draw is not counted, so the retry row by row draws the same.
            broken = ~torch.isfinite(xs.amax(dim=-1))
            stream = [(self._seed(reqs[i]), reqs[i].rng_draws) for i in sampled]
            counters = to_device(torch.tensor([[_signed(s) for s, _ in stream], [k for _, k in stream]]), x.device)
            drawn = _draw(xs, counter_uniforms(counters[0], counters[1]))
            tokens[idx] = drawn.clamp_(max=v - 1)  # a broken row's search may land past the vocabulary
        else:
            broken = None

        logprobs: list[TokenLogprob | None] = [None] * b
        lp_rows = [i for i in range(b) if want_lp[i]]
        if lp_rows:
            if broken is not None and bool(broken.any()):
                raise NonFiniteLogitsError([reqs[sampled[j]].rid for j in broken.nonzero().flatten().tolist()])
            idx = tensor_on(lp_rows, x.device)
            top_n = max(params[i].top_logprobs_num for i in lp_rows)
            for i, entry in zip(lp_rows, token_logprobs(x[idx], tokens[idx], top_n), strict=True):
                entry.top = entry.top[: params[i].top_logprobs_num]
                logprobs[i] = entry
            token_ids = tokens.tolist()
        else:
            flat = torch.cat([tokens, broken.long()]).tolist() if broken is not None else tokens.tolist()
            token_ids = flat[:b]
            bad = [reqs[sampled[j]].rid for j, f in enumerate(flat[b:]) if f]
            if bad:
                raise NonFiniteLogitsError(bad)
        for i in sampled:
            reqs[i].rng_draws += 1
        return SampleOutput(token_ids, logprobs)

    def verify(self, logits: torch.Tensor, req: Req, draft: Sequence[int]) -> tuple[list[int], int]:
        """``(accepted drafts, the token after them)`` from ``logits`` [len(draft) + 1, V']: row ``i`` is the
        target's distribution for the token after draft ``i - 1`` (row 0: after the request's last token).

        Greedy: a draft is kept while it equals the row's argmax; the next token is the argmax after the last
        kept one. Sampled (the request's temperature, top_k, top_p, min_p): row ``i`` draws its token from ``p_i``
        with the uniform plain decoding would use for that output position (the request's next draw), and the
        draft is kept while it equals the drawn token; the first token that differs, or the one after every kept
        draft, is the next token. For a proposal that puts all its mass on ``d`` (drafts are deterministic: an
        n-gram continuation, the draft model's argmax) this keeps ``d`` with probability ``p_i(d)`` and emits
        tokens distributed exactly as the target's; and as every emitted token takes exactly one draw, a seeded
        request's tokens do not depend on whether, or how far, a step drafted (which depends on the batch: the
        draft model's shared catch-up budget, free slots). Speculating requests have no penalties or logprobs
        (``runtime.speculative.can_speculate``); a constrained request's rows come masked by its grammar
        (``runtime.grammar.draft_mask``), so its target is the constrained distribution.
        """
        x = logits[: len(draft) + 1, : self.vocab_size]
        if not bool(torch.isfinite(x.amax(dim=-1)).all()):
            raise NonFiniteLogitsError([req.rid])
        params = req.params
        if params.greedy:
            best = x.argmax(dim=-1).tolist()
            kept = 0
            while kept < len(draft) and draft[kept] == best[kept]:
                kept += 1
            return list(draft[:kept]), best[kept]
        xs = _filter(x.to(torch.float32, copy=True), [params] * x.shape[0])
        for i in range(len(draft) + 1):
            u = torch.tensor([self._uniform(req)], dtype=torch.float64, device=x.device)
            token = int(_draw(xs[i : i + 1], u)[0])
            if i == len(draft) or token != draft[i]:
                return list(draft[:i]), token
        raise AssertionError("unreachable")
