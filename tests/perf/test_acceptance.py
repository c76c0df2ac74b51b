"""perf/acceptance.py: the loop's acceptance per draft position equals the rule's promise (and a wrong rule shows)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from exact_stats import sharp_tiny_target, tiny_drafter

from dflash_jax.decoding import loop as gen
from dflash_jax.decoding import sampling
from dflash_jax.decoding.api import pad_prompts
from dflash_jax.decoding.loop import SpecConfig, SpeculativeLoop
from dflash_jax.decoding.proposers import DFlashProposer
from dflash_jax.decoding.sampling import RowSampling, SamplingConfig
from dflash_jax.perf.acceptance import measure

V, SHARPNESS, BLOCK, ROWS = 8, 10.0, 4, 96
T06 = SamplingConfig(temperature=0.6, draft_mode="sampled")  # = the default's drafts; one compiled program


def _pair(vocab=V, sharpness=SHARPNESS):
    """(target, drafter, (prompts, lengths)): a tiny pair whose p and q are neither uniform nor one-hot."""
    target = sharp_tiny_target(vocab, sharpness)
    drafter = tiny_drafter(vocab, block_size=BLOCK, target_layer_ids=(0, 1))
    prompts = np.random.default_rng(0).integers(0, vocab - 1, (ROWS, 3)).tolist()
    return target, drafter, pad_prompts(prompts, 4)


@pytest.fixture(scope="module")
def pair():
    return _pair()


def _measure(pair, sampling_cfg, rows=None, capacity=None, max_new=12, tree=None):
    target, drafter, (tokens, lens) = pair
    spec = SpecConfig(block_size=BLOCK, max_new_tokens=max_new, sampling=sampling_cfg, stop_ids=(), capacity=capacity,
                      tree_budget=tree)
    loop = SpeculativeLoop.of(target, DFlashProposer(drafter.cfg, drafter.graphdef), spec)
    return measure(loop, (target.params, drafter.params), tokens, lens, rng=5, rows=rows)


def test_greedy_acceptance_is_the_argmax_match_exactly(pair):
    stats = _measure(pair, SamplingConfig())
    np.testing.assert_array_equal(stats.accepted, stats.rule)
    assert stats.reached[0] == stats.steps > 0
    # The per-position rates reproduce the measured tau: tokens per step = 1 + accepted drafts per step.
    assert stats.tokens <= stats.steps + stats.accepted.sum()


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_sampled_acceptance_matches_the_rule_and_a_wrong_rule_shows(pair, mode, monkeypatch):
    cfg = SamplingConfig(temperature=0.6, draft_mode=mode)
    stats = _measure(pair, cfg)
    assert stats.reached.sum() > 300 and 0.1 < stats.rule.sum() / stats.reached.sum() < 0.9  # neither 0 nor 1
    assert abs(stats.z()) < 4.5, stats.summary()
    overlap = stats.rate("overlap")  # Σ min(p, q) is at most 1 and, with sampled drafts, is the rule's mean
    assert np.nanmax(overlap) <= 1 + 1e-5
    if mode == "sampled":
        assert abs(stats.overlap.sum() - stats.rule.sum()) < 4.5 * np.sqrt(stats.rule_var.sum())

    # The temperature applied twice in the rule (p at T^2): the measurement flags it.
    def twice(drafts, q, logits, keys, rules):
        return sampling.accept(drafts, q, logits / rules.temperature, keys, rules)

    monkeypatch.setattr(gen, "accept", twice)
    wrong = _measure(pair, cfg, capacity=40)  # another capacity: a new program that traces the patched rule
    assert abs(wrong.z()) > 5, wrong.summary()


@pytest.mark.slow
def test_per_row_settings_match_the_rule(pair):
    """Greedy rows, rows with sampled drafts (the default) and rows with greedy drafts in one batch."""
    modes = ("auto", "auto", "greedy")
    rows = RowSampling.of([SamplingConfig(temperature=0.0 if b % 4 == 0 else 0.8, draft_mode=modes[b % 3])
                           for b in range(ROWS)])
    stats = _measure(pair, SamplingConfig(), rows=rows)
    assert abs(stats.z()) < 4.5, stats.summary()
    assert np.isfinite(stats.rate("overlap")).all() and np.nanmax(stats.rate("overlap")) <= 1 + 1e-5


def test_summary_and_expected_tau(pair):
    stats = _measure(pair, T06)  # the configuration of the tests above: compiled
    summary = stats.summary()
    assert summary["steps"] == stats.steps and len(summary["accepted"]) == BLOCK - 1
    rates = np.nan_to_num(stats.rate("accepted"))
    assert stats.expected_tau("accepted") == pytest.approx(1 + np.cumprod(rates).sum())
    with pytest.raises(ValueError, match="block_size 1"):
        target, drafter, (tokens, lens) = pair
        loop = SpeculativeLoop.of(target, spec=SpecConfig(block_size=1, max_new_tokens=4))
        measure(loop, (target.params, ()), tokens, lens)


def test_tau_is_the_loops(pair):
    stats = _measure(pair, T06)
    target, drafter, (tokens, lens) = pair
    spec = SpecConfig(block_size=BLOCK, max_new_tokens=12, sampling=T06, stop_ids=())
    out = SpeculativeLoop.of(target, DFlashProposer(drafter.cfg, drafter.graphdef), spec).run(
        (target.params, drafter.params), jnp.asarray(tokens), jnp.asarray(lens), 5)
    assert stats.steps == int(np.asarray(out.steps).sum())
    counts = np.arange(1, BLOCK + 1)
    assert stats.accepted.sum() + stats.steps == int((np.asarray(out.accepted) * counts).sum())


@pytest.mark.slow  # ~10 s of CPU: a tree loop's compilation; the tree itself is tests/decoding's and tests/models'
def test_a_tree_loop_is_measured_by_its_tau(pair):
    """Draft trees (``tree_budget``): the measured τ, steps and accepted drafts are the loop's own (``run``), and the
    per-position rates, which a tree's nodes do not have, are NaN rather than a chain's reading of its nodes."""
    stats = _measure(pair, T06, tree=5)
    target, drafter, (tokens, lens) = pair
    spec = SpecConfig(block_size=BLOCK, max_new_tokens=12, sampling=T06, stop_ids=(), tree_budget=5)
    out = SpeculativeLoop.of(target, DFlashProposer(drafter.cfg, drafter.graphdef), spec).run(
        (target.params, drafter.params), jnp.asarray(tokens), jnp.asarray(lens), 5)
    assert stats.steps == int(np.asarray(out.steps).sum()) and stats.tau == pytest.approx(float(np.mean(out.tau)))
    assert stats.accepted.sum() > 0 and np.isnan(stats.rate("rule")).all()
