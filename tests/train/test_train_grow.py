"""train/grow.py: the grown target computes the old target's logits (function-preserving growth)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from train_fixtures import tiny_target

from dflash_jax.models.target import Target
from dflash_jax.train import grow


def _perturbed(target: Target, seed: int = 1) -> Target:
    """Every parameter moved off its initial value (a fresh target's norm weights are all zero)."""
    leaves, tree = jax.tree.flatten(target.params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    moved = [x + 0.3 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)]
    return Target(target.cfg, target.graphdef, jax.tree.unflatten(tree, moved))


def test_grown_target_computes_the_old_logits(tmp_path):
    old = _perturbed(tiny_target())
    cfg = grow.grown_config(old.cfg, hidden=48, layers=8, intermediate=96, heads=4, kv_heads=2, linear_key_heads=2,
                            linear_value_heads=4)
    grown = grow.grow(old, cfg, tmp_path / "grown", seed=5)
    assert grown.cfg.num_hidden_layers == 8 and grown.cfg.layer_types[3] == "full_attention"
    tokens = np.random.default_rng(0).integers(2, 64, (2, 24)).astype(np.int32)
    # With a vanishing eps the growth is exact up to float32 rounding; the real eps moves logits a little.
    assert grow.check(old, grown, tokens, eps=1e-30) < 1e-4
    assert grow.check(old, grown, tokens) < 1e-2
    # The new capacity is really there: the new layers' read weights are random, their writes zero.
    p = grown.params["model"]["layers"][3]["self_attn"]
    assert float(jnp.abs(p["q_proj"]["weight"][...]).max()) > 0 and not np.any(np.asarray(p["o_proj"]["weight"][...]))


def test_growth_refuses_to_shrink_or_regroup_heads():
    old = tiny_target()
    with pytest.raises(ValueError, match="shrink hidden_size"):
        grow.grow_tensors(old, grow.grown_config(old.cfg, hidden=16, layers=4, intermediate=64, heads=2, kv_heads=1,
                                                 linear_key_heads=1, linear_value_heads=2))
    with pytest.raises(ValueError, match="group size"):
        grow.grow_tensors(old, grow.grown_config(old.cfg, hidden=32, layers=4, intermediate=64, heads=4, kv_heads=1,
                                                 linear_key_heads=1, linear_value_heads=2))
