"""Tests of the batched sampler: greedy, seeds, filters, penalties, masks and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

import radixserve.runtime.logprobs as logprobs_mod
import radixserve.runtime.sampler as sampler_mod
from radixserve.runtime.logprobs import token_logprobs
from radixserve.runtime.request import Req
from radixserve.runtime.sampler import TOP_WINDOW, NoAllowedTokenError, NonFiniteLogitsError, Sampler
from radixserve.runtime.sampling_params import SamplingParams

V = 50
EOS = 0
CPU = torch.device("cpu")


def make_req(rid: str = "r", prompt: list[int] | None = None, output: list[int] | None = None, **params) -> Req:
    req = Req(rid, prompt if prompt is not None else [1, 2, 3], SamplingParams(**params))
    req.output_ids = list(output or [])
    return req


def make_sampler(seed: int = 0) -> Sampler:
    return Sampler(V, [EOS], CPU, seed=seed)


def rand_logits(rows: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=g) * scale


def processed_logprobs(logits_row: torch.Tensor, req: Req, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """The full log-distribution the sampler reports for one row (every alternative requested)."""
    req.params.return_logprob = True
    req.params.top_logprobs_num = V
    out = make_sampler().sample(logits_row[None], [req], allowed)
    entry = out.logprobs[0]
    assert entry is not None
    full = torch.full((V,), float("-inf"))
    for tid, lp in entry.top:
        full[tid] = lp
    return full


# ---------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype: torch.dtype) -> None:
    logits = rand_logits(6, seed=1).to(dtype)
    reqs = [make_req(f"g{i}", temperature=0.0) for i in range(6)]
    out = make_sampler().sample(logits, reqs)
    assert out.token_ids == logits.float().argmax(-1).tolist()
    assert out.logprobs == [None] * 6
    assert all(r.rng_seed is None and r.rng_draws == 0 for r in reqs)  # the fast path draws nothing


def test_input_logits_are_not_modified() -> None:
    logits = rand_logits(3, seed=2)
    before = logits.clone()
    reqs = [
        make_req("a", temperature=0.7, top_p=0.5, repetition_penalty=1.5, logit_bias={3: 5.0}),
        make_req("b", temperature=0.0, frequency_penalty=1.0, output=[4, 4]),
        make_req("c", min_new_tokens=3, min_p=0.2, return_logprob=True),
    ]
    make_sampler().sample(logits, reqs, torch.ones(3, V, dtype=torch.bool))
    assert torch.equal(logits, before)


def test_top_k_one_and_tiny_top_p_equal_greedy() -> None:
    logits = rand_logits(8, seed=3)
    expected = logits.argmax(-1).tolist()
    for params in ({"top_k": 1}, {"top_p": 1e-6}, {"top_p": 1e-6, "temperature": 5.0}):
        reqs = [make_req(f"r{i}", seed=i, **params) for i in range(8)]
        for _ in range(5):
            assert make_sampler().sample(logits, reqs).token_ids == expected


def test_padding_columns_are_never_picked() -> None:
    logits = torch.cat([rand_logits(4, seed=4), torch.full((4, 14), 1e4)], dim=1)
    reqs = [
        make_req("g", temperature=0.0),
        make_req("s", seed=1, repetition_penalty=1.3, output=[2, 3]),
        make_req("t", top_k=5, logit_bias={4: 2.0}),
        make_req("u", frequency_penalty=1.0, output=[V - 1, 5]),
    ]
    for _ in range(20):
        assert all(t < V for t in make_sampler().sample(logits, reqs).token_ids)


# ---------------------------------------------------------------------------- seeds


def _run_steps(sampler: Sampler, reqs: list[Req], row: int, steps: int, logits_seed: int) -> list[int]:
    """Sample ``steps`` tokens for ``reqs``; row ``row`` always sees the same logits sequence."""
    g = torch.Generator().manual_seed(logits_seed)
    target = []
    for step in range(steps):
        logits = rand_logits(len(reqs), seed=1000 + step)
        logits[row] = torch.randn(V, generator=g) * 2.0
        out = sampler.sample(logits, reqs)
        for r, t in zip(reqs, out.token_ids, strict=True):
            r.output_ids.append(t)
        target.append(out.token_ids[row])
    return target


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1.0},
        {"temperature": 0.7, "top_p": 0.9},
        {"temperature": 1.3, "top_k": 10, "min_p": 0.05},
    ],
)
def test_seed_is_independent_of_batch(params: dict) -> None:
    alone = _run_steps(make_sampler(seed=1), [make_req("x", seed=1234, **params)], 0, 12, logits_seed=7)

    others = [
        make_req("o0", seed=5),
        make_req("o1"),
        make_req("o2", temperature=0.0),
        make_req("o3", top_k=3, repetition_penalty=1.3),
        make_req("o4", top_p=0.5, frequency_penalty=0.5, presence_penalty=0.3),
        make_req("o5", seed=99, min_p=0.3, logit_bias={7: 2.0}),
        make_req("o6", min_new_tokens=5, temperature=0.5),
    ]
    batch = others[:3] + [make_req("x", seed=1234, **params)] + others[3:]
    batched = _run_steps(make_sampler(seed=2), batch, 3, 12, logits_seed=7)
    assert batched == alone

    # Another position, another sampler seed: still the same tokens.
    batch = [make_req("x", seed=1234, **params)] + [make_req(f"u{i}") for i in range(7)]
    assert _run_steps(make_sampler(seed=3), batch, 0, 12, logits_seed=7) == alone


def test_different_seeds_differ_and_unseeded_requests_get_seeds() -> None:
    runs = [_run_steps(make_sampler(), [make_req("x", seed=s)], 0, 12, logits_seed=8) for s in range(4)]
    assert len({tuple(r) for r in runs}) > 1
    reqs = [make_req("a"), make_req("b")]
    make_sampler().sample(rand_logits(2, seed=9), reqs)
    assert all(isinstance(r.rng_seed, int) and r.rng_draws == 1 for r in reqs)
    assert reqs[0].rng_seed != reqs[1].rng_seed
    # Unseeded streams' seeds come from the sampler's seed: the same engine seed replays the same choices.
    a = _run_steps(make_sampler(seed=11), [make_req("a"), make_req("b")], 1, 8, logits_seed=9)
    b = _run_steps(make_sampler(seed=11), [make_req("a"), make_req("b")], 1, 8, logits_seed=9)
    assert a == b


# ---------------------------------------------------------------------------- distributions


def _frequencies(logits_row: torch.Tensor, n: int, **params) -> torch.Tensor:
    reqs = [make_req(f"s{i}", **params) for i in range(n)]
    out = make_sampler(seed=5).sample(logits_row.expand(n, V).contiguous(), reqs)
    return torch.bincount(torch.tensor(out.token_ids), minlength=V).float() / n


def test_temperature_one_matches_softmax() -> None:
    logits = torch.full((V,), -30.0)
    logits[:6] = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5])
    n = 4000
    freq = _frequencies(logits, n)
    probs = torch.softmax(logits, -1)
    tol = 4 * torch.sqrt(probs * (1 - probs) / n) + 1e-3
    assert torch.all((freq - probs).abs() <= tol), (freq[:6], probs[:6])


def test_temperature_top_k_top_p_distribution() -> None:
    logits = torch.full((V,), -30.0)
    logits[:6] = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5])
    n = 4000
    # temperature 2, top_k 4: softmax(x / 2) over the best four.
    freq = _frequencies(logits, n, temperature=2.0, top_k=4)
    expected = torch.zeros(V)
    expected[:4] = torch.softmax(logits[:4] / 2.0, -1)
    assert torch.all((freq - expected).abs() <= 4 * torch.sqrt(expected * (1 - expected) / n) + 1e-3)
    # top_p 0.6 keeps the smallest prefix whose mass reaches 0.6 (here the best two).
    probs = torch.softmax(logits, -1)
    assert probs[0] < 0.6 < probs[0] + probs[1]
    freq = _frequencies(logits, n, top_p=0.6)
    expected = torch.zeros(V)
    expected[:2] = probs[:2] / probs[:2].sum()
    assert torch.all((freq - expected).abs() <= 4 * torch.sqrt(expected * (1 - expected) / n) + 1e-3)


def test_min_p_drops_unlikely_tokens() -> None:
    logits = torch.full((V,), -5.0)
    logits[:3] = torch.tensor([3.0, 2.9, 1.0])  # p2 / p0 = exp(-2) ~ 0.135
    freq = _frequencies(logits, 2000, min_p=0.2)
    assert freq[0] > 0.3 and freq[1] > 0.3
    assert freq[2:].sum() == 0
    freq = _frequencies(logits, 2000, min_p=0.1)
    assert freq[2] > 0 and freq[3:].sum() == 0


def reference_keep(x: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Tokens a row keeps, computed the plain way: one full sort per step, thresholds on values."""
    x = x / temperature
    keep = torch.ones_like(x, dtype=torch.bool)
    if 0 < top_k < x.numel():
        keep &= x >= x.sort(descending=True).values[top_k - 1]
    if top_p < 1.0:
        vals = x.masked_fill(~keep, float("-inf")).sort(descending=True).values
        probs = torch.softmax(vals, -1)
        before = torch.cumsum(probs, -1) - probs
        keep &= x >= vals[int((before <= top_p).sum()) - 1]
    if min_p > 0.0:
        keep &= x >= x.max() + math.log(min_p)
    return keep


def test_filters_match_reference_beyond_the_window() -> None:
    """Vocabularies larger than the top-k/top-p window, values with many ties, cuts on both sides of it."""
    vocab = 4 * TOP_WINDOW
    g = torch.Generator().manual_seed(21)
    settings = [
        (1.0, 5, 1.0, 0.0),
        (0.8, 2 * TOP_WINDOW, 1.0, 0.0),  # top_k past the window: full sort
        (1.0, -1, 0.3, 0.0),
        (1.0, -1, 0.95, 0.0),  # flat rows put this cut past the window
        (1.5, 40, 0.7, 0.05),
        (1.0, 3 * TOP_WINDOW, 0.9, 0.0),
        (0.7, -1, 1.0, 0.1),
    ]
    for scale in (0.3, 3.0):
        x = torch.round(torch.randn(len(settings), vocab, generator=g) * scale * 2) / 2  # ties on purpose
        reqs = [
            make_req(f"r{i}", temperature=t, top_k=k, top_p=p, min_p=m, seed=i)
            for i, (t, k, p, m) in enumerate(settings)
        ]
        filtered = sampler_mod._filter(x.clone(), [r.params for r in reqs])
        for i, (t, k, p, m) in enumerate(settings):
            assert torch.equal(torch.isfinite(filtered[i]), reference_keep(x[i], t, k, p, m)), settings[i]
        out = Sampler(vocab, [EOS], CPU).sample(x, reqs)
        for i, tok in enumerate(out.token_ids):
            assert reference_keep(x[i], *settings[i])[tok]


def test_draw_never_lands_on_zero_weight_tokens() -> None:
    xs = torch.full((4, V), float("-inf"))
    xs[:, 3], xs[:, 7] = 0.0, 1.0
    uniforms = torch.tensor([0.0, 1.0 - 2**-53, 0.5, 0.2], dtype=torch.float64)
    tokens = sampler_mod._draw(xs, uniforms).tolist()
    assert tokens[0] == 3 and tokens[1] == 7 and set(tokens) <= {3, 7}


# ---------------------------------------------------------------------------- bias and penalties


def test_logit_bias_forces_a_token() -> None:
    logits = rand_logits(4, seed=12)
    reqs = [
        make_req("a", logit_bias={7: 100.0}),
        make_req("b", temperature=0.0, logit_bias={9: 100.0}),
        make_req("c", temperature=0.0),
        make_req("d", logit_bias={int(logits[3].argmax()): -100.0}, temperature=0.0),
    ]
    out = make_sampler().sample(logits, reqs)
    assert out.token_ids[:3] == [7, 9, int(logits[2].argmax())]
    assert out.token_ids[3] != int(logits[3].argmax())


def test_repetition_penalty_hf_semantics() -> None:
    logits = torch.zeros(V)
    logits[3], logits[4], logits[5] = 2.0, -1.0, 1.0
    req = make_req("r", prompt=[3, 9], output=[4], temperature=0.0, repetition_penalty=2.0)
    expected = logits.clone()
    expected[3], expected[4] = 1.0, -2.0  # seen: positive divided, negative multiplied; 5 unseen; 9 is 0
    got = processed_logprobs(logits, req)
    torch.testing.assert_close(got, torch.log_softmax(expected, -1))


def test_frequency_and_presence_penalties_use_output_only() -> None:
    logits = torch.zeros(V)
    req = make_req(
        "r", prompt=[7, 7], output=[5, 5, 5, 6], temperature=0.0, frequency_penalty=0.5, presence_penalty=1.0
    )
    expected = logits.clone()
    expected[5] -= 0.5 * 3 + 1.0
    expected[6] -= 0.5 * 1 + 1.0  # token 7 appears only in the prompt: untouched
    torch.testing.assert_close(processed_logprobs(logits, req), torch.log_softmax(expected, -1))
    # A negative presence penalty encourages repetition.
    req = make_req("r", output=[5], temperature=0.0, presence_penalty=-2.0)
    assert make_sampler().sample(torch.zeros(1, V), [req]).token_ids == [5]


def test_penalties_change_sampled_choices() -> None:
    logits = torch.full((1, V), 0.5)
    logits[0, 3] = 1.0
    req = make_req("r", temperature=0.0, output=[3], frequency_penalty=2.0)
    assert make_sampler().sample(logits, [req]).token_ids != [3]
    req = make_req("r", prompt=[3], temperature=0.0, repetition_penalty=4.0)
    assert make_sampler().sample(logits, [req]).token_ids != [3]
    # A penalty below 1 rewards repetition instead.
    logits[0, 3] = 0.4
    req = make_req("r", prompt=[3], temperature=0.0, repetition_penalty=0.5)
    assert make_sampler().sample(logits, [req]).token_ids == [3]


# ---------------------------------------------------------------------------- masks


def test_min_new_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.zeros(1, V)
    logits[0, EOS], logits[0, 8], logits[0, 9] = 10.0, 9.0, 8.0
    s = make_sampler()
    req = make_req("r", temperature=0.0, min_new_tokens=2, stop_token_ids=[8])
    assert s.sample(logits, [req]).token_ids == [9]
    req.output_ids = [1, 1]
    assert s.sample(logits, [req]).token_ids == [EOS]
    # ignore_eos: EOS is left alone (the scheduler won't stop on it) but stop ids are still held off.
    req = make_req("r", temperature=0.0, min_new_tokens=2, stop_token_ids=[8], ignore_eos=True)
    assert s.sample(logits, [req]).token_ids == [EOS]
    logits[0, EOS] = -10.0
    assert s.sample(logits, [req]).token_ids == [9]
    # Sampled rows never draw a masked id either.
    reqs = [make_req(f"s{i}", temperature=5.0, min_new_tokens=1, stop_token_ids=[8]) for i in range(200)]
    logits[0, EOS] = 10.0
    assert not {EOS, 8} & set(s.sample(logits.expand(200, V), reqs).token_ids)


def test_min_new_tokens_yields_to_a_grammar_that_can_only_end() -> None:
    allowed = torch.zeros(1, V, dtype=torch.bool)
    allowed[0, EOS] = True
    req = make_req("r", min_new_tokens=5)
    assert make_sampler().sample(rand_logits(1, seed=13), [req], allowed).token_ids == [EOS]


def test_allowed_mask_is_respected() -> None:
    n = 64
    g = torch.Generator().manual_seed(14)
    allowed = torch.rand(n, V, generator=g) < 0.1
    allowed[:, 0] = False
    allowed[torch.arange(n), torch.randint(1, V, (n,), generator=g)] = True
    logits = rand_logits(n, seed=15, scale=10.0)
    reqs = [
        make_req(f"r{i}", temperature=[0.0, 1.0, 3.0][i % 3], top_p=0.9 if i % 2 else 1.0, repetition_penalty=1.2)
        for i in range(n)
    ]
    for _ in range(5):
        out = make_sampler().sample(logits, reqs, allowed)
        assert all(allowed[i, t] for i, t in enumerate(out.token_ids))
    greedy = [make_req(f"g{i}", temperature=0.0) for i in range(n)]
    tokens = make_sampler().sample(logits, greedy, allowed).token_ids
    assert tokens == logits.masked_fill(~allowed, float("-inf")).argmax(-1).tolist()


def test_row_with_nothing_allowed_raises_naming_the_request() -> None:
    allowed = torch.ones(3, V, dtype=torch.bool)
    allowed[1] = False
    reqs = [make_req("ok0"), make_req("bad-req", temperature=0.0), make_req("ok2")]
    with pytest.raises(ValueError, match="bad-req") as info:
        make_sampler().sample(rand_logits(3, seed=16), reqs, allowed)
    assert isinstance(info.value, NoAllowedTokenError) and info.value.rids == ["bad-req"]


def test_tiny_temperatures_are_greedy_and_non_finite_rows_fail_alone() -> None:
    """temperature=1e-40 once divided logits into inf and nan, and the draw returned token id V (past the
    vocabulary), which failed every request of the batch."""
    logits = rand_logits(3, seed=21)
    tiny = [make_req(f"t{i}", temperature=t, seed=1) for i, t in enumerate((1e-40, 1e-45, 1e-6))]
    assert make_sampler().sample(logits, tiny).token_ids == logits.argmax(-1).tolist()
    broken = logits.clone()
    broken[1, 7] = float("nan")
    reqs = [make_req("ok0", seed=3), make_req("nan-row", seed=3), make_req("ok2", seed=3)]
    with pytest.raises(ValueError, match="nan-row") as info:
        make_sampler().sample(broken, reqs)
    assert isinstance(info.value, NonFiniteLogitsError) and info.value.rids == ["nan-row"]
    assert all(r.rng_draws == 0 for r in reqs), "no draw is counted before raising: the retry stays reproducible"
    for value in (1e-300, 1e300, float("inf"), float("nan"), 0.0):
        with pytest.raises(ValueError, match="repetition_penalty"):
            SamplingParams(repetition_penalty=value).validate(V)


# ---------------------------------------------------------------------------- logprobs


def test_logprobs_match_log_softmax_before_temperature() -> None:
    logits = rand_logits(4, seed=17)
    reqs = [
        make_req("a", temperature=0.0, return_logprob=True, top_logprobs_num=5),
        make_req("b", temperature=0.5, top_k=3, return_logprob=True, top_logprobs_num=3, seed=1),
        make_req("c"),
        make_req("d", return_logprob=True, logit_bias={2: 3.0}),
    ]
    out = make_sampler().sample(logits, reqs)
    ref = torch.log_softmax(logits, -1)
    for i in (0, 1):
        entry = out.logprobs[i]
        assert entry is not None and entry.token_id == out.token_ids[i]
        assert math.isclose(entry.logprob, ref[i, entry.token_id].item(), abs_tol=1e-5)
        vals = [lp for _, lp in entry.top]
        assert len(entry.top) == reqs[i].params.top_logprobs_num
        assert vals == sorted(vals, reverse=True)
        top_ref = ref[i].topk(len(vals))
        assert [t for t, _ in entry.top] == top_ref.indices.tolist()
        torch.testing.assert_close(torch.tensor(vals), top_ref.values)
    assert out.logprobs[2] is None
    entry = out.logprobs[3]
    assert entry is not None and entry.top == []
    biased = logits[3].clone()
    biased[2] += 3.0
    assert math.isclose(entry.logprob, torch.log_softmax(biased, -1)[entry.token_id].item(), abs_tol=1e-5)


def test_logprobs_of_an_all_sampled_batch_ignore_the_filters() -> None:
    logits = rand_logits(3, seed=22)
    reqs = [
        make_req(f"r{i}", temperature=0.5, top_k=2, min_p=0.3, return_logprob=True, top_logprobs_num=2, seed=i)
        for i in range(3)
    ]
    out = make_sampler().sample(logits, reqs)
    ref = torch.log_softmax(logits, -1)
    for i, entry in enumerate(out.logprobs):
        assert entry is not None
        assert math.isclose(entry.logprob, ref[i, out.token_ids[i]].item(), abs_tol=1e-5)
        torch.testing.assert_close(torch.tensor([lp for _, lp in entry.top]), ref[i].topk(2).values)


def test_logprobs_drop_masked_alternatives() -> None:
    allowed = torch.zeros(1, V, dtype=torch.bool)
    allowed[0, [3, 4]] = True
    got = processed_logprobs(rand_logits(1, seed=18)[0], make_req("r", temperature=0.0), allowed)
    assert torch.isfinite(got).sum() == 2
    torch.testing.assert_close(got.exp().sum(), torch.tensor(1.0))


@pytest.mark.parametrize("chunk_elems", [1 << 26, V * 3])
def test_token_logprobs_batched(monkeypatch: pytest.MonkeyPatch, chunk_elems: int) -> None:
    monkeypatch.setattr(logprobs_mod, "_LOGPROB_CHUNK_ELEMS", chunk_elems)
    logits = rand_logits(10, seed=19).to(torch.bfloat16)
    targets = torch.randint(0, V, (10,), generator=torch.Generator().manual_seed(20))
    ref = torch.log_softmax(logits.float(), -1)
    out = token_logprobs(logits, targets, top_n=4)
    assert [e.token_id for e in out] == targets.tolist()
    torch.testing.assert_close(torch.tensor([e.logprob for e in out]), ref[torch.arange(10), targets])
    for i, e in enumerate(out):
        assert [t for t, _ in e.top] == ref[i].topk(4).indices.tolist()
        torch.testing.assert_close(torch.tensor([lp for _, lp in e.top]), ref[i].topk(4).values)
    assert all(e.top == [] and e.rank is None for e in token_logprobs(logits, targets, top_n=0))
    # Ranks as vLLM counts them: a tie ranks as its last place.
    tied = torch.tensor([[3.0, 2.0, 2.0, 1.0]]).repeat(4, 1).to(torch.bfloat16)
    ranked = token_logprobs(tied, torch.tensor([0, 1, 2, 3]), top_n=0, ranks=True)
    assert [e.rank for e in ranked] == [1, 3, 3, 4]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mask_disallowed_equals_masked_fill(dtype: torch.dtype) -> None:
    """The bias-add masking (fast on CPU) gives exactly what ``masked_fill_(~allowed, -inf)`` gives, infinities
    and nan included (an allowed nan stays nan, a disallowed one or a disallowed +inf reads -inf)."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 1000, generator=gen) * 30).to(dtype)
    special = torch.tensor([float("inf"), float("-inf"), 0.0, float("nan")], dtype=dtype)
    x[0, :4] = special
    x[1, :4] = special
    allowed = torch.rand(6, 1000, generator=gen) < 0.3
    allowed[0, :4] = False
    allowed[1, :4] = True
    want = x.masked_fill(~allowed, float("-inf"))
    got = sampler_mod._mask_disallowed(x.clone(), allowed)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))


def test_counter_uniforms_match_the_host_draws_bit_for_bit() -> None:
    """The streams' uniforms in int64 tensor ops (wrapping multiplies) against Python's unbounded integers, over
    seeds that cover the sign bit, and their spread."""
    from radixserve.runtime.sampler import _signed, counter_uniforms, uniform_at

    seeds = [0, 1, 42, 2**62 + 12345, 2**63 - 1, 2**63, 2**64 - 1, 0x9E3779B97F4A7C15]
    counters = [0, 1, 7, 1000, 2**31, 5, 3, 2]
    got = counter_uniforms(torch.tensor([_signed(x) for x in seeds]), torch.tensor(counters)).tolist()
    assert got == [uniform_at(x, k) for x, k in zip(seeds, counters, strict=True)]
    many = counter_uniforms(torch.full((20000,), 7), torch.arange(20000))
    assert many.min().item() >= 0.0 and many.max().item() < 1.0
    assert abs(many.mean().item() - 0.5) < 0.01 and abs(many.var().item() - 1 / 12) < 0.005


def test_a_retried_row_draws_what_it_would_have_drawn() -> None:
    """A batch that fails on one non-finite row counts no draw: the same rows then sampled one by one give the
    tokens they get in a batch without the broken row."""
    logits = rand_logits(3, seed=4)
    broken = logits.clone()
    broken[1, 3] = float("nan")
    fresh = [make_req(f"r{i}", seed=10 + i) for i in range(3)]
    clean = make_sampler().sample(logits[[0, 2]], [fresh[0], fresh[2]]).token_ids
    reqs = [make_req(f"r{i}", seed=10 + i) for i in range(3)]
    sampler = make_sampler()
    with pytest.raises(NonFiniteLogitsError):
        sampler.sample(broken, reqs)
    alone = [sampler.sample(broken[i : i + 1], [reqs[i]]).token_ids[0] for i in (0, 2)]
    assert alone == clean
