"""Layer helpers of ``layers.py`` against numpy: per-row cache writes, the conv window slide, the two
RMSNorm conventions, the Gated DeltaNet's head-grouped channel order (the layer on HF-ordered weights
against a numpy q | k | v reference), and kernel-mode switching that keeps the weight arrays.

The layers themselves are checked against transformers through the whole target (``test_target.py``)
and against z-lab's formulas through the drafter (``test_drafter.py``).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax import parallel
from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.models.drafter import init_drafter
from dflash_jax.models.layers import GatedDeltaNet, RMSNorm, gdn_channel_order, gdn_channels, slide_window

# Hk = 2 key heads, r = 3 value heads per key head, Dk != Dv: every piece of the order has its own size.
GDN = TargetConfig(vocab_size=16, hidden_size=12, num_hidden_layers=1, layer_types=("linear_attention",),
                   num_attention_heads=2, num_key_value_heads=1, head_dim=8, linear_num_key_heads=2,
                   linear_num_value_heads=6, linear_key_head_dim=4, linear_value_head_dim=3, intermediate_size=8)
QKV, CONV = "model.layers.0.linear_attn.in_proj_qkv.weight", "model.layers.0.linear_attn.conv1d.weight"


def test_slide_window_keeps_the_last_inputs_up_to_the_kept_token():
    rng = np.random.default_rng(1)
    window = rng.normal(size=(4, 3, 5)).astype(np.float32)  # K-1 = 3 previous conv inputs
    mixed = rng.normal(size=(4, 6, 5)).astype(np.float32)  # T = 6 new inputs
    n = np.array([0, 1, 4, 6])
    got = np.asarray(slide_window(jnp.asarray(window), jnp.asarray(mixed), jnp.asarray(n)))
    for b in range(4):
        seen = np.concatenate([window[b], mixed[b, :n[b]]])  # everything up to the n-th kept token
        np.testing.assert_array_equal(got[b], seen[-3:])


def test_gdn_channel_order_groups_whole_heads_by_key_head():
    Hk, Hv, Dk, Dv = 2, 6, 4, 3
    hf = ([("q", h, d) for h in range(Hk) for d in range(Dk)] + [("k", h, d) for h in range(Hk) for d in range(Dk)]
          + [("v", j, d) for j in range(Hv) for d in range(Dv)])  # the checkpoint's q | k | v
    order = gdn_channel_order(GDN)
    assert sorted(order.tolist()) == list(range(len(hf)))  # a permutation of C = 2*Hk*Dk + Hv*Dv
    internal = [hf[i] for i in order]
    group = 2 * Dk + Hv // Hk * Dv
    for g in range(Hk):  # [q head g | k head g | v heads 3g .. 3g+2]
        want = ([("q", g, d) for d in range(Dk)] + [("k", g, d) for d in range(Dk)]
                + [("v", j, d) for j in range(3 * g, 3 * g + 3) for d in range(Dv)])
        assert internal[g * group:(g + 1) * group] == want


def test_gdn_channels_round_trip_and_leave_other_tensors_alone():
    """The GDN channel tensors are those whose parameter declares axis 0 ``gdn_channels`` (the layer's fused
    q|k|v projection and its conv weight, as built); every other tensor passes through."""
    rng = np.random.default_rng(3)
    w = rng.normal(size=(GDN.conv_dim, 5)).astype(np.float32)
    layer = nnx.eval_shape(lambda: GatedDeltaNet(GDN, dtype=jnp.float32, kernels="reference", rngs=nnx.Rngs(0)))
    for key, a, var in ((QKV, w, layer.in_proj_qkv.weight), (CONV, w[:, None], layer.conv1d.weight)):  # conv [C, 1, K]
        moved = gdn_channels(GDN, key, a, parallel.param_axes(var))
        assert not np.array_equal(moved, a)
        np.testing.assert_array_equal(gdn_channels(GDN, key, moved, parallel.param_axes(var), to_hf=True), a)
    other, axes = "model.layers.0.linear_attn.in_proj_z.weight", parallel.param_axes(layer.in_proj_z.weight)
    assert gdn_channels(GDN, other, w, axes) is w and gdn_channels(GDN, other, w, axes, to_hf=True) is w
    with pytest.raises(ValueError, match="in_proj_qkv.weight: 5 rows, but the GDN channel axis of this config has 34"):
        gdn_channels(GDN, QKV, w[:5], parallel.param_axes(layer.in_proj_qkv.weight))


@pytest.mark.parametrize("speculative", [False, True])  # the two forms of the causal conv
def test_gdn_layer_on_hf_weights_matches_a_q_k_v_reference(speculative):
    """The layer given HF-ordered weights through ``gdn_channels`` (as the loader does) against the
    checkpoint's own layout read the plain way: channels q | k | v, conv, SiLU, q/k L2 norm."""
    rng = np.random.default_rng(4)
    B, T, K = 2, 5, GDN.linear_conv_kernel_dim
    Hk, Hv, Dk, Dv, C = 2, 6, 4, 3, GDN.conv_dim
    w_qkv = rng.normal(size=(C, GDN.hidden_size)).astype(np.float32)  # HF order [C, D]
    w_conv = rng.normal(size=(C, 1, K)).astype(np.float32)
    x = rng.normal(size=(B, T, GDN.hidden_size)).astype(np.float32)
    window = rng.normal(size=(B, K - 1, C)).astype(np.float32)  # previous raw conv inputs, HF order

    layer = GatedDeltaNet(GDN, dtype=jnp.float32, kernels="reference", rngs=nnx.Rngs(0))
    qkv_axes, conv_axes = parallel.param_axes(layer.in_proj_qkv.weight), parallel.param_axes(layer.conv1d.weight)
    layer.in_proj_qkv.weight.set_value(jnp.asarray(gdn_channels(GDN, QKV, w_qkv, qkv_axes)))
    layer.conv1d.weight.set_value(jnp.asarray(gdn_channels(GDN, CONV, w_conv, conv_axes)))
    q, k, v, _, _, _, mixed = layer._prepare(jnp.asarray(x), jnp.asarray(window[..., gdn_channel_order(GDN)]),
                                            speculative=speculative)

    ref_mixed = x @ w_qkv.T  # [B, T, C]
    full = np.concatenate([window, ref_mixed], axis=1)
    y = sum(full[:, j:j + T] * w_conv[:, 0, j] for j in range(K))
    y = y / (1 + np.exp(-y))
    rq, rk = y[..., :Hk * Dk].reshape(B, T, Hk, Dk), y[..., Hk * Dk:2 * Hk * Dk].reshape(B, T, Hk, Dk)
    rq = rq / np.sqrt((rq * rq).sum(-1, keepdims=True) + 1e-6) * Dk**-0.5
    rk = rk / np.sqrt((rk * rk).sum(-1, keepdims=True) + 1e-6)
    for got, want in ((q, rq), (k, rk), (v, y[..., 2 * Hk * Dk:].reshape(B, T, Hv, Dv))):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    # The raw inputs kept for the conv window are in the layer's order; back in HF order they are x W^T.
    np.testing.assert_allclose(gdn_channels(GDN, CONV, np.asarray(mixed).transpose(2, 0, 1), conv_axes, to_hf=True),
                               ref_mixed.transpose(2, 0, 1), rtol=1e-5, atol=1e-5)


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

    from dflash_jax.models.drafter import Drafter

    cfg = DrafterConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                        head_dim=16, intermediate_size=48, vocab_size=64, block_size=4, mask_token_id=63,
                        target_layer_ids=(0,), num_target_layers=2)
    d = init_drafter(cfg, kernels="reference")
    module = d.module()
    module.fc.kernels = "interpret"
    odd = Drafter(cfg, *nnx.split(module))
    assert (d.kernels, odd.kernels) == ("reference", "reference")
