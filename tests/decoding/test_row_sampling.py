"""Per-row sampling settings (``RowSampling``, what a server's slots carry) against ``SamplingConfig``'s rules:
each row's distribution, choice and acceptance are those of its own config applied alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.decoding.sampling import RowSampling, SamplingConfig, accept, choose, probs

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
