"""Models from a config alone: random weights on the device, abstract shapes, the real Qwen3.5 shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.config import ConfigError
from dflash_jax.models.drafter import load_drafter
from dflash_jax.models.target import load_target
from dflash_jax.perf import synthetic

ASSETS = "dflash_jax/assets"


def _shapes(params):
    return {p: (v.get_value().shape, v.get_value().dtype) for p, v in nnx.to_flat_state(params)}


@pytest.fixture(scope="module")
def pair():
    target = synthetic.random_target(f"{ASSETS}/target", dtype=jnp.float32, seed=3)
    return target, synthetic.random_drafter(f"{ASSETS}/drafter/config.json", target)


def test_random_models_have_the_checkpoint_tree(pair):
    """Same parameter paths, shapes and dtypes as the shipped checkpoints loaded from disk."""
    target, drafter = pair
    shipped = load_target(f"{ASSETS}/target", dtype=jnp.float32, mtp=False, progress=False)
    assert _shapes(target.params) == _shapes(shipped.params)
    assert _shapes(drafter.params) == _shapes(load_drafter(f"{ASSETS}/drafter", shipped, progress=False).params)
    leaves = jax.tree.leaves(target.params) + jax.tree.leaves(drafter.params)
    assert all(isinstance(x, jax.Array) and np.isfinite(np.asarray(x)).all() for x in leaves)
    weight = np.asarray(target.params["model"]["layers"][0]["mlp"]["up_proj"]["weight"].get_value())
    assert 0.015 < weight.std() < 0.025  # N(0, 0.02^2): random, not zeros or a constant
    other = synthetic.random_target(target.cfg, dtype=jnp.float32, seed=4)
    assert not np.array_equal(weight, np.asarray(other.params["model"]["layers"][0]["mlp"]["up_proj"]["weight"]
                                                 .get_value()))


def test_random_target_runs(pair):
    target, _ = pair
    out, _ = target.prefill(np.array([[5, 6, 7, 8]]), np.array([4]), capacity=8)
    assert out.logits.shape == (1, target.cfg.vocab_size) and np.isfinite(np.asarray(out.logits)).all()


@pytest.mark.slow
def test_abstract_models_allocate_nothing():
    raw_target, raw_drafter = synthetic.REAL_SHAPES["27b"]
    target = synthetic.abstract_target(raw_target)
    drafter = synthetic.abstract_drafter(raw_drafter)
    leaves = jax.tree.leaves(target.params) + jax.tree.leaves(drafter.params)
    assert all(isinstance(x, jax.ShapeDtypeStruct) and x.dtype in (jnp.bfloat16, jnp.float32) for x in leaves)


@pytest.mark.parametrize("name, billions", [("27b", 26.90), ("35b-a3b", 34.66)])
def test_real_shapes_have_the_published_sizes(name, billions):
    """Text parameters of HF's Qwen3.5 instantiated on the meta device."""
    raw_target, raw_drafter = synthetic.REAL_SHAPES[name]
    target = synthetic.abstract_target(raw_target)
    assert sum(x.size for x in jax.tree.leaves(target.params)) / 1e9 == pytest.approx(billions, abs=0.005)
    synthetic.abstract_drafter(raw_drafter)  # parses
    from dflash_jax.models.drafter import check_fits
    check_fits(synthetic.drafter_config(raw_drafter), target.cfg)


def test_a_drafter_for_another_target_is_refused(pair):
    target, _ = pair
    with pytest.raises(ConfigError, match="hidden_size"):
        synthetic.random_drafter(synthetic.REAL_SHAPES["27b"][1], target)
