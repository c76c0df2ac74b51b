"""Per-row sampling settings (``RowSampling``, what a server's slots carry) against ``SamplingConfig``'s rules:
each row's distribution, choice, drafts (its own draft mode) and acceptance are those of its own config applied
alone, and a mixed batch's emitted tokens have exactly each row's target distribution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from exact_stats import chi2_pvalue

from dflash_jax.decoding.sampling import RowSampling, SamplingConfig, accept, argmax, choose, draft_tokens, probs

CONFIGS = [SamplingConfig(0.0), SamplingConfig(0.7), SamplingConfig(1.3, top_k=5), SamplingConfig(1.0, top_p=0.8),
           SamplingConfig(0.9, top_k=7, top_p=0.6), SamplingConfig(2.0, top_k=1)]


def _logits(shape, seed=0):
    return jax.random.normal(jax.random.key(seed), shape) * 3  # continuous: no ties at a cut-off


def test_row_probs_equal_each_rows_config():
    logits = _logits((len(CONFIGS), 3, 64))
    rows = probs(logits, RowSampling.of(CONFIGS))
    for b, cfg in enumerate(CONFIGS):
        if cfg.greedy:
            continue  # a greedy row's choice is the argmax; its distribution is not used
        np.testing.assert_allclose(rows[b], probs(logits[b], cfg), atol=1e-6, err_msg=str(cfg))


def test_row_choose_is_each_rows_choice():
    logits = _logits((len(CONFIGS), 64), seed=1)
    keys = jax.random.split(jax.random.key(2), len(CONFIGS))
    got = choose(logits, keys, RowSampling.of(CONFIGS))
    for b, cfg in enumerate(CONFIGS):
        assert int(got[b]) == int(choose(logits[b:b + 1], keys[b:b + 1], cfg)[0]), cfg


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_row_accept_is_each_rows_rule_with_greedy_drafts(seed):
    B, k, V = len(CONFIGS), 4, 16
    logits = _logits((B, k + 1, V), seed=seed)
    # drafts that often agree with the target's argmax, so several acceptance counts occur
    drafts = jnp.where(jax.random.bernoulli(jax.random.key(seed + 10), 0.7, (B, k)), jnp.argmax(logits[:, :k], -1),
                       jax.random.randint(jax.random.key(seed + 20), (B, k), 0, V)).astype(jnp.int32)
    keys = jax.random.split(jax.random.key(seed + 30), B)
    a, bonus = accept(drafts, None, logits, keys, RowSampling.of(CONFIGS))
    for b, cfg in enumerate(CONFIGS):
        a1, bonus1 = accept(drafts[b:b + 1], None, logits[b:b + 1], keys[b:b + 1], cfg)
        assert (int(a[b]), int(bonus[b])) == (int(a1[0]), int(bonus1[0])), cfg


# Every kind of row in one batch: greedy, sampled with sampled drafts (the default), sampled with greedy drafts.
DRAFTING = [SamplingConfig(0.0), SamplingConfig(1.0), SamplingConfig(1.0, draft_mode="greedy"),
            SamplingConfig(0.7, top_k=5), SamplingConfig(0.9, top_p=0.8, draft_mode="sampled"),
            SamplingConfig(1.3, top_k=7, draft_mode="greedy")]


def test_sampled_requests_draft_sampled_by_default():
    assert SamplingConfig(0.7).draft_mode == "auto" and SamplingConfig(0.7).sampled_drafts
    assert not SamplingConfig().sampled_drafts and not SamplingConfig(0.0, draft_mode="sampled").sampled_drafts
    assert not SamplingConfig(0.7, draft_mode="greedy").sampled_drafts
    np.testing.assert_array_equal(RowSampling.of(DRAFTING).sampled_drafts, [c.sampled_drafts for c in DRAFTING])


def test_row_drafts_follow_each_rows_draft_mode():
    """Each row's drafts and q are those of its own config alone (same key): sampled rows draw from q (and so
    leave the argmax somewhere in 12 flat positions), argmax rows draft the argmax with q one-hot."""
    B, k, V = len(DRAFTING), 12, 64
    logits = _logits((B, k, V), seed=3) / 3  # flat: a draw from q is rarely the argmax at every position
    keys = jax.random.split(jax.random.key(4), B)
    tokens, q = jax.jit(draft_tokens)(logits, keys, RowSampling.of(DRAFTING))
    best = np.asarray(argmax(logits))
    alone_fn = jax.jit(draft_tokens, static_argnums=2)
    for b, cfg in enumerate(DRAFTING):
        alone, q_alone = alone_fn(logits[b:b + 1], keys[b:b + 1], cfg)
        np.testing.assert_array_equal(tokens[b], alone[0], err_msg=str(cfg))
        want_q = jax.nn.one_hot(alone[0], V) if q_alone is None else q_alone[0]
        np.testing.assert_allclose(q[b], want_q, atol=1e-6, err_msg=str(cfg))
        assert (np.asarray(tokens[b]) != best[b]).any() == cfg.sampled_drafts, cfg
    greedy = RowSampling.of([SamplingConfig(), SamplingConfig(1.0, draft_mode="greedy")])  # no row samples
    tokens, q = jax.jit(draft_tokens)(logits[:2], keys[:2], greedy)
    np.testing.assert_array_equal(tokens, best[:2])
    np.testing.assert_array_equal(q, jax.nn.one_hot(best[:2], V))


@jax.jit
def _step(p_logits, q_logits, keys, rows, wrong_q):
    """One step's rule on B rows: drafts from q_logits [B, 2, V] (each row's mode), accepted against p_logits
    [B, 3, V]; ``wrong_q``: q reversed over the vocabulary in the acceptance (a wrong rule)."""
    drafts, q = draft_tokens(q_logits, keys[:, 0], rows)
    q = jnp.where(wrong_q, q[..., ::-1], q)
    return drafts, *accept(drafts, q, p_logits, keys[:, 1], rows)


def _mixed_first_two(configs, n, wrong_q=False):
    """The first two tokens a step emits for n rows of each config (one batch, drafts by each row's mode), from
    fixed target logits [3, V] and draft logits [2, V]: (target logits, {config index: (first [n], second)})."""
    V = 8
    rng = np.random.default_rng(0)
    p_logits = jnp.asarray(rng.normal(size=(3, V)) * 1.5, jnp.float32)  # target logits at anchor, d1, d2
    q_logits = jnp.asarray(rng.normal(size=(2, V)) * 1.5, jnp.float32)  # draft logits for d1, d2
    rows = RowSampling.of([c for c in configs for _ in range(n)])
    B = n * len(configs)
    keys = jax.random.split(jax.random.key(1), 2 * B).reshape(B, 2)
    drafts, a, bonus = map(np.asarray, _step(jnp.broadcast_to(p_logits, (B, 3, V)),
                                             jnp.broadcast_to(q_logits, (B, 2, V)), keys, rows, wrong_q))
    first = np.where(a >= 1, drafts[:, 0], bonus)
    second = np.where(a >= 2, drafts[:, 1], bonus)
    out = {}
    for i in range(len(configs)):
        rows_i = slice(i * n, (i + 1) * n)
        out[i] = (first[rows_i], second[rows_i][a[rows_i] >= 1])
    return p_logits, out


def test_a_mixed_batch_emits_each_rows_target_distribution():
    """Sampled-draft, greedy-draft and greedy rows in one batch: each row's first token ~ its p_0 and, given d_1
    accepted, its second ~ p_1 (the lossless rule, per row); a wrong q for the sampled drafts is seen."""
    configs = [SamplingConfig(1.0), SamplingConfig(1.0, draft_mode="greedy"), SamplingConfig(0.7, top_k=5),
               SamplingConfig(0.0)]
    p_logits, got = _mixed_first_two(configs, 12000)
    for i, cfg in enumerate(configs):
        first, second = got[i]
        if cfg.greedy:
            best = np.asarray(argmax(p_logits))
            assert (first == best[0]).all() and (second == best[1]).all()
            continue
        p = np.asarray(probs(p_logits, cfg))
        assert chi2_pvalue(np.bincount(first, minlength=8), p[0]) > 1e-4, cfg
        assert chi2_pvalue(np.bincount(second, minlength=8), p[1]) > 1e-4, cfg
    _, wrong = _mixed_first_two(configs, 12000, wrong_q=True)  # the same program
    assert chi2_pvalue(np.bincount(wrong[0][0], minlength=8), np.asarray(probs(p_logits, configs[0]))[0]) < 1e-6
