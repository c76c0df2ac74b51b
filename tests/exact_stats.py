"""Goodness of fit against an exact distribution (the oracle of the sampling and loop tests)."""

from __future__ import annotations

import numpy as np


def chi2_pvalue(counts, expected_p) -> float:
    """Pearson chi-square p-value of counts against a distribution (cells with tiny mass pooled)."""
    from scipy.stats import chi2

    counts, expected = np.asarray(counts, float), np.asarray(expected_p, float) * np.sum(counts)
    small = expected < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    stat = np.sum((counts - expected) ** 2 / np.maximum(expected, 1e-12))
    return chi2.sf(stat, len(counts) - 1)


def sharp_tiny_target(vocab: int = 8, sharpness: float = 150.0):
    """A hybrid two-layer target with a vocabulary small enough to enumerate, its head scaled so that p and a
    drafter's q differ visibly (random init gives near-uniform logits, which a wrong rule would not betray)."""
    from dflash_jax.config import TargetConfig
    from dflash_jax.models.target import init_target

    cfg = TargetConfig(vocab_size=vocab, hidden_size=16, num_hidden_layers=2,
                       layer_types=("linear_attention", "full_attention"), num_attention_heads=2,
                       num_key_value_heads=1, head_dim=8, linear_num_key_heads=1, linear_num_value_heads=2,
                       linear_key_head_dim=8, linear_value_head_dim=8, intermediate_size=24)
    target = init_target(cfg, seed=3)
    head = target.params["lm_head"]["weight"]
    head.set_value(head.get_value() * sharpness)
    return target


def tiny_drafter(vocab: int = 8, **changes):
    """A one-layer DFlash drafter (random, seed 4) for ``sharp_tiny_target(vocab)``: block 3, reading the target's
    first layer; ``changes`` replace config fields."""
    import dataclasses

    from dflash_jax.config import DrafterConfig
    from dflash_jax.models.drafter import init_drafter

    cfg = DrafterConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                        head_dim=16, intermediate_size=24, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=vocab,
                        block_size=3, mask_token_id=vocab - 1, target_layer_ids=(0,), num_target_layers=2,
                        layer_types=("full_attention",), sliding_window=None, is_causal=None,
                        target_hidden_size=16)
    return init_drafter(dataclasses.replace(cfg, **changes), seed=4)


def exact_joint(target, prompt, cfg, n: int = 3) -> np.ndarray:
    """P(the first n generated tokens) [V**n] of plain sampling with ``cfg`` after ``prompt``, every prefix
    enumerated through the target's prefill."""
    import itertools

    from dflash_jax.decoding.sampling import probs

    V = target.cfg.vocab_size
    joint = np.ones([1])
    for depth in range(n):
        prefixes = np.array(list(itertools.product(range(V), repeat=depth)), np.int32).reshape(V**depth, depth)
        rows = np.concatenate([np.tile(prompt, (V**depth, 1)), prefixes], axis=1).astype(np.int32)
        out, _ = target.prefill(rows, [rows.shape[1]] * len(rows), capacity=rows.shape[1])
        joint = (joint[:, None] * np.asarray(probs(out.logits, cfg))).reshape(-1)
    return joint
