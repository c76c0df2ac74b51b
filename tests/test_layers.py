"""Layer helpers of ``layers.py`` against numpy: per-row cache writes, the conv window slide, the two
RMSNorm conventions, and kernel-mode switching that keeps the weight arrays.

The layers themselves are checked against transformers through the whole target (``test_target.py``)
and against z-lab's formulas through the drafter (``test_drafter.py``).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.drafter import DrafterConfig, init_drafter
from dflash_jax.layers import RMSNorm, slide_window, write_rows


def test_write_rows_writes_each_row_at_its_own_start():
    rng = np.random.default_rng(0)
    cache = rng.normal(size=(3, 10, 2)).astype(np.float32)
    new = rng.normal(size=(3, 4, 2)).astype(np.float32)
    start = np.array([0, 3, 6])
    want = cache.copy()
    for b, s in enumerate(start):
        want[b, s:s + 4] = new[b]
    np.testing.assert_array_equal(write_rows(jnp.asarray(cache), jnp.asarray(new), jnp.asarray(start)), want)


def test_slide_window_keeps_the_last_inputs_up_to_the_kept_token():
    rng = np.random.default_rng(1)
    window = rng.normal(size=(4, 3, 5)).astype(np.float32)  # K-1 = 3 previous conv inputs
    mixed = rng.normal(size=(4, 6, 5)).astype(np.float32)  # T = 6 new inputs
    n = np.array([0, 1, 4, 6])
    got = np.asarray(slide_window(jnp.asarray(window), jnp.asarray(mixed), jnp.asarray(n)))
    for b in range(4):
        seen = np.concatenate([window[b], mixed[b, :n[b]]])  # everything up to the n-th kept token
        np.testing.assert_array_equal(got[b], seen[-3:])


@pytest.mark.parametrize("zero_centred", [True, False])
def test_rms_norm_conventions(zero_centred):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(2, 7, 16)).astype(np.float32) * 3
    w = rng.normal(size=16).astype(np.float32)
    norm = RMSNorm(16, 1e-6, zero_centred=zero_centred, dtype=jnp.float32)
    norm.weight.set_value(jnp.asarray(w))
    x_hat = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6)
    want = x_hat * ((1 + w) if zero_centred else w)  # Qwen3.5 stores offsets from 1; Qwen3 the scale
    np.testing.assert_allclose(norm(jnp.asarray(x)), want, rtol=1e-5, atol=1e-5)


def test_with_kernels_changes_the_graph_not_the_weights():
    cfg = DrafterConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                        head_dim=16, intermediate_size=48, vocab_size=64, block_size=4, mask_token_id=63,
                        target_layer_ids=(0,), num_target_layers=2)
    d = init_drafter(cfg, kernels="reference")
    other = d.with_kernels("interpret")
    assert (d.kernels, other.kernels) == ("reference", "interpret") and other.graphdef != d.graphdef
    assert other.params is d.params
    with pytest.raises(ValueError, match="unknown kernel mode"):
        d.with_kernels("fast")


def test_kernels_is_the_root_modules_mode():
    """SplitModel.kernels is the root module's attribute: a child's own ``kernels`` (here fc's, ahead of the
    root's in the definition) is not mistaken for it."""
    from flax import nnx

    from dflash_jax.drafter import Drafter

    cfg = DrafterConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                        head_dim=16, intermediate_size=48, vocab_size=64, block_size=4, mask_token_id=63,
                        target_layer_ids=(0,), num_target_layers=2)
    d = init_drafter(cfg, kernels="reference")
    module = d.module()
    module.fc.kernels = "interpret"
    odd = Drafter(cfg, *nnx.split(module))
    assert (d.kernels, odd.kernels) == ("reference", "reference")
