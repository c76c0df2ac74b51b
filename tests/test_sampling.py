"""Sampling transforms and the lossless acceptance rules, checked against exact distributions."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import sampling
from dflash_jax import speculative as gen
from dflash_jax.config import TargetConfig
from dflash_jax.drafter import DrafterConfig, init_drafter
from dflash_jax.proposers import DFlashProposer
from dflash_jax.sampling import SamplingConfig, accept, probs
from dflash_jax.speculative import SpecConfig, make_generate, pad_prompts
from dflash_jax.target import init_target

V = 8


def _chi2_pvalue(counts, expected_p):
    """Pearson chi-square p-value of counts against a distribution (cells with tiny mass pooled)."""
    from scipy.stats import chi2

    counts, expected = np.asarray(counts, float), np.asarray(expected_p, float) * np.sum(counts)
    small = expected < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    stat = np.sum((counts - expected) ** 2 / np.maximum(expected, 1e-12))
    return chi2.sf(stat, len(counts) - 1)


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
    assert _chi2_pvalue(np.bincount(first, minlength=V), p[0]) > 1e-4
    second = np.where(np.asarray(a) >= 2, np.asarray(drafts[:, 1]), np.asarray(bonus))[np.asarray(a) >= 1]
    assert _chi2_pvalue(np.bincount(second, minlength=V), p[1]) > 1e-4


def _tiny_vocab_target():
    cfg = TargetConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2,
                       layer_types=("linear_attention", "full_attention"), num_attention_heads=2,
                       num_key_value_heads=1, head_dim=8, linear_num_key_heads=1, linear_num_value_heads=2,
                       linear_key_head_dim=8, linear_value_head_dim=8, intermediate_size=24)
    target = init_target(cfg, seed=3)
    # Random init gives near-uniform logits; a sharper head makes distinct p and q that a wrong rule betrays.
    head = target.params["lm_head"]["weight"]
    head.set_value(head.get_value() * 150.0)
    return target


def _exact_joint(target, prompt, cfg, n=3):
    """P(first n generated tokens) of plain sampling, by enumerating every prefix."""
    joint = np.ones([1])
    for depth in range(n):
        prefixes = np.array(list(itertools.product(range(V), repeat=depth)), np.int32).reshape(V**depth, depth)
        rows = np.concatenate([np.tile(prompt, (V**depth, 1)), prefixes], axis=1).astype(np.int32)
        out, _ = target.prefill(rows, [rows.shape[1]] * len(rows), capacity=rows.shape[1])
        step = np.asarray(probs(out.logits, cfg))  # [V**depth, V]
        joint = (joint[:, None] * step).reshape(-1)
    return joint


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_speculative_sampling_matches_exact_distribution(mode, monkeypatch):
    target = _tiny_vocab_target()
    dcfg = DrafterConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, intermediate_size=24, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=V,
                         block_size=3, mask_token_id=V - 1, target_layer_ids=(0,), num_target_layers=2,
                         layer_types=("full_attention",), sliding_window=None, is_causal=None,
                         target_hidden_size=16)
    drafter = init_drafter(dcfg, seed=4)
    cfg = SamplingConfig(temperature=1.0, draft_mode=mode)
    prompt = np.array([1, 5, 2], np.int32)
    exact = _exact_joint(target, prompt, cfg)
    N = 6000
    spec = SpecConfig(block_size=3, max_new_tokens=3, sampling=cfg, stop_ids=())
    tokens, lengths = pad_prompts([prompt.tolist()] * N, 4)

    def sample_joint():
        fn = jax.jit(make_generate(target, DFlashProposer(dcfg, drafter.graphdef), spec))
        out = fn((target.params, drafter.params), tokens, lengths, jax.random.key(7))
        seqs = np.asarray(out.tokens)
        assert (np.asarray(out.steps) >= 1).all()
        return np.bincount(np.ravel_multi_index(seqs.T, (V,) * 3), minlength=V**3)

    counts = sample_joint()
    # Compare the marginals of the 2nd and 3rd token (decided by the acceptance rule) and their joint.
    joint3 = exact.reshape(V, V, V)
    c3 = counts.reshape(V, V, V)
    assert _chi2_pvalue(c3.sum((0, 2)), joint3.sum((0, 2))) > 1e-4
    assert _chi2_pvalue(c3.sum((0, 1)), joint3.sum((0, 1))) > 1e-4
    assert _chi2_pvalue(c3.sum(0).ravel(), joint3.sum(0).ravel()) > 1e-4

    # The same statistic rejects a wrong rule (always accept the drafts): the test has power.
    def accept_all(drafts, q, logits, keys, scfg):
        a = jnp.full(drafts.shape[:1], drafts.shape[1], jnp.int32)
        return a, sampling.choose(logits[:, -1], keys, scfg)

    monkeypatch.setattr(gen, "accept", accept_all)
    wrong = sample_joint().reshape(V, V, V)
    assert _chi2_pvalue(wrong.sum(0).ravel(), joint3.sum(0).ravel()) < 1e-6


def test_batch_row_equals_the_prompt_run_alone():
    target = _tiny_vocab_target()
    keys = jax.random.split(jax.random.key(11), 3)
    prompts = [[1, 2, 3], [4, 5], [6, 1, 1, 2]]
    spec = SpecConfig(block_size=1, max_new_tokens=6, sampling=SamplingConfig(temperature=1.0), stop_ids=())
    fn = jax.jit(make_generate(target, gen.NoProposer(), spec))
    batch = fn((target.params, ()), *pad_prompts(prompts, 8), keys)
    alone = fn((target.params, ()), *pad_prompts(prompts[1:2], 8), keys[1:2])
    assert batch.texts()[1] == alone.texts()[0]
