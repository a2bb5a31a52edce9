"""Log-probabilities of given tokens from logits: the sampled ones (``runtime.sampler``) and the prompt's
(``runtime.model_runner``), with the best alternatives and, for the prompt, each token's rank."""

from __future__ import annotations

import torch

from radixserve.runtime.request import TokenLogprob

# Rows per chunk, sized so a float32 copy of one chunk stays near 256 MiB.
_LOGPROB_CHUNK_ELEMS = 1 << 26
_NEG_INF = float("-inf")


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, top_n: int, ranks: bool = False) -> list[TokenLogprob]:
    """``log_softmax(logits)[i, targets[i]]`` and the ``top_n`` best alternatives per row, sorted descending;
    with ``ranks``, each target's rank too: the tokens scored at least as high, itself included (vLLM's count, so
    a tie ranks as its last place).

    Batched over rows; long inputs (prompt logprobs) are processed in row chunks so the float32 working copy
    stays bounded. ``logits`` is [N, V] of any float dtype, ``targets`` is [N] of token ids. Alternatives at
    -inf (masked tokens) are left out: they say nothing and are not valid JSON numbers.
    """
    n, v = logits.shape
    targets = targets.to(device=logits.device, dtype=torch.long)
    chunk = max(1, _LOGPROB_CHUNK_ELEMS // max(v, 1))
    out: list[TokenLogprob] = []
    for start in range(0, n, chunk):
        x = logits[start : start + chunk].float()
        tgt = targets[start : start + chunk]
        # logits - logsumexp equals log_softmax without materializing another [N, V] tensor.
        lse = torch.logsumexp(x, dim=-1, keepdim=True)
        picked = x.gather(1, tgt[:, None])
        chosen = (picked - lse).squeeze(1).tolist()
        rank = (x >= picked).sum(dim=-1).tolist() if ranks else [None] * len(chosen)
        if top_n <= 0:
            out.extend(TokenLogprob(t, lp, rank=r) for t, lp, r in zip(tgt.tolist(), chosen, rank, strict=True))
            continue
        top_vals, top_ids = x.topk(min(top_n, v), dim=-1)
        rows = zip(tgt.tolist(), chosen, (top_vals - lse).tolist(), top_ids.tolist(), rank, strict=True)
        for t, lp, vals, ids, r in rows:
            top = [(i, val) for i, val in zip(ids, vals, strict=True) if val != _NEG_INF]
            out.append(TokenLogprob(t, lp, top, r))
    return out
