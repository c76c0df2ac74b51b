"""Sampling transforms and the lossless acceptance rules, checked against exact distributions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from exact_stats import chi2_pvalue
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dflash_jax.decoding import sampling
from dflash_jax.decoding.sampling import SamplingConfig, accept, probs

V = 8


def test_probs_transforms_match_formulas():
    logits = jnp.array([2.0, 1.0, 0.5, 0.5, -1.0, -3.0])
    t = 0.7
    ref = np.exp(np.asarray(logits) / t)
    np.testing.assert_allclose(probs(logits, SamplingConfig(temperature=t)), ref / ref.sum(), rtol=1e-6)
    top2 = np.where(np.arange(6) < 2, ref, 0)
    np.testing.assert_allclose(probs(logits, SamplingConfig(temperature=t, top_k=2)), top2 / top2.sum(), rtol=1e-6)
    p = ref / ref.sum()  # sorted already; top-p keeps the smallest prefix with mass >= top_p
    keep = (np.cumsum(p) - p) < 0.8
    np.testing.assert_allclose(probs(logits, SamplingConfig(temperature=t, top_p=0.8)),
                               np.where(keep, p, 0) / np.where(keep, p, 0).sum(), rtol=1e-6)


@settings(max_examples=60, deadline=None)
@given(logits=st.lists(st.floats(-8, 8, width=32), min_size=V, max_size=V, unique=True),
       temperature=st.floats(0.25, 4.0), top_k=st.integers(0, V), top_p=st.floats(0.05, 1.0))
def test_filters_keep_the_smallest_top_set_in_proportion(logits, temperature, top_k, top_p):
    """For any logits: the support is the highest-logit tokens, at most top_k of them, the fewest whose mass
    (after temperature and top-k) reaches top_p; inside it the probabilities keep exp(logit / T)'s ratios.
    Logits closer than 1e-3 are left out: in float32 they can tie (XLA on CPU flushes 8e-45 to 0.0; x / T can
    round two neighbours to one value), and a tie keeps both tokens, as transformers' top-k does."""
    assume(np.diff(np.sort(logits)).min() > 1e-3)
    x = np.asarray(logits, np.float64) / temperature
    got = np.asarray(probs(jnp.asarray(logits, jnp.float32), SamplingConfig(temperature, top_k, top_p)), np.float64)
    assert np.isfinite(got).all() and (got >= 0).all() and abs(got.sum() - 1) < 1e-5
    order = np.argsort(-x)
    kept = np.flatnonzero(got[order] > 0)
    n = len(kept)
    assert n >= 1 and (kept == np.arange(n)).all()  # a prefix of the tokens by logit
    k = top_k or V
    assert n <= k
    after_k = np.exp(x[order][:k] - x[order][0])
    after_k /= after_k.sum()  # the distribution top-p sees
    mass = np.cumsum(after_k)
    assert mass[n - 1] >= top_p - 1e-5 and (n == 1 or mass[n - 2] < top_p + 1e-5)  # reaches top_p, minimal
    ref = after_k[:n] / after_k[:n].sum()
    np.testing.assert_allclose(got[order][:n], ref, rtol=1e-4, atol=1e-7)


# No subnormals: XLA's CPU code flushes them to zero (1.4e-45 ties with 0.0 there, not in numpy).
@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.lists(st.sampled_from([-np.inf, np.inf, np.nan, -1.5, 0.0, 0.0, 2.0, 3.25, 3.25]) |
                              st.floats(-4, 4, width=32, allow_subnormal=False), min_size=V, max_size=V),
                     min_size=1, max_size=4),
       dtype=st.sampled_from([jnp.float32, jnp.bfloat16]))
def test_argmax_is_numpys_first_nan_else_first_peak(rows, dtype):
    """The two-reduction argmax picks what numpy's does: ties (repeated values are drawn often) go to the
    first, a NaN anywhere wins at its first index, +-inf rank as numbers."""
    x = jnp.asarray(np.array(rows, np.float32), dtype)
    got = jax.jit(sampling.argmax)(x)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, np.argmax(np.asarray(x, np.float32), axis=-1))


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_acceptance_rule_emits_target_distribution(mode):
    """First emitted token ~ p_0 and, given d_1 accepted, the second ~ p_1, for many independent draws."""
    rng = np.random.default_rng(0)
    p_logits = jnp.asarray(rng.normal(size=(3, V)) * 1.5, jnp.float32)  # target logits at anchor, d1, d2
    q_logits = jnp.asarray(rng.normal(size=(2, V)) * 1.5, jnp.float32)  # draft logits for d1, d2
    cfg = SamplingConfig(temperature=1.0, draft_mode=mode)
    N = 60000
    keys = jax.random.split(jax.random.key(1), 2 * N).reshape(N, 2)
    drafts, q = jax.vmap(lambda k: sampling.draft_tokens(q_logits[None], k[None], cfg))(keys[:, 0])
    drafts = drafts[:, 0]
    q = None if q is None else q[:, 0]
    a, bonus = accept(drafts, q, jnp.broadcast_to(p_logits, (N, 3, V)), keys[:, 1], cfg)
    first = np.where(np.asarray(a) >= 1, np.asarray(drafts[:, 0]), np.asarray(bonus))
    p = np.asarray(probs(p_logits, cfg))
    assert chi2_pvalue(np.bincount(first, minlength=V), p[0]) > 1e-4
    second = np.where(np.asarray(a) >= 2, np.asarray(drafts[:, 1]), np.asarray(bonus))[np.asarray(a) >= 1]
    assert chi2_pvalue(np.bincount(second, minlength=V), p[1]) > 1e-4


@pytest.mark.parametrize("kw, message", [
    (dict(temperature=-0.5), "temperature must be >= 0"),
    (dict(temperature=float("nan")), "temperature must be >= 0 and finite"),
    (dict(temperature=float("inf")), "temperature must be >= 0 and finite"),
    (dict(temperature="0.7"), "temperature must be a number"),
    (dict(temperature=1.0, top_p=0.0), "top_p must be in"),
    (dict(temperature=1.0, top_p=1.5), "top_p must be in"),
    (dict(temperature=1.0, top_p=float("nan")), "top_p must be in"),
    (dict(temperature=1.0, top_k=-1), "top_k must be an integer >= 0"),
    (dict(temperature=1.0, top_k=2.5), "top_k must be an integer >= 0"),
    (dict(temperature=1.0, top_k=True), "top_k must be an integer >= 0"),
    (dict(temperature=1.0, draft_mode="beam"), "draft_mode must be one of"),
])
def test_sampling_config_is_validated_at_construction(kw, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**kw)


def test_sampling_config_normalises_numbers():
    """numpy scalars and ints become plain Python numbers: equal settings hash alike (one compiled program)."""
    a = SamplingConfig(temperature=np.float32(0.5), top_k=np.int64(3), top_p=1)
    assert a == SamplingConfig(temperature=0.5, top_k=3, top_p=1.0) and hash(a) == hash(SamplingConfig(0.5, 3))
    assert type(a.temperature) is float and type(a.top_k) is int
