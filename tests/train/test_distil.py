"""train/drafter.py's distillation loss (KL to the target's distribution at a temperature) and train/distil.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from train_fixtures import tiny_target

from dflash_jax.models import drafter as dr
from dflash_jax.models.target import forward
from dflash_jax.train import distil
from dflash_jax.train import drafter as dt


def test_distil_loss_is_the_weighted_kl_to_the_targets_next_token_distribution():
    target = tiny_target()
    cfg = dt.drafter_config(target.cfg, num_layers=1, taps=(0, 2), mask_token_id=1, block_size=4, heads=2,
                            kv_heads=1, head_dim=16, intermediate=64)
    drafter = dr.init_drafter(cfg, seed=3)
    tokens = jnp.asarray(np.random.default_rng(0).integers(2, 64, (2, 20)), jnp.int32)
    out = forward(target.graphdef, target.params, tokens, taps=cfg.target_layer_ids)
    anchors = np.array([[3, 9], [5, 14]], np.int32)
    T = 0.7
    batch = {"tokens": tokens, "taps": out.taps, "anchors": anchors, "hidden": out.hidden}
    loss, _ = dt.drafter_loss_fn(drafter.graphdef, target.graphdef, cfg, distil_temperature=T)(
        drafter.params, target.params, batch)
    # The oracle: p from the target's own full-sequence logits (position i - 1 predicts token i), q from the
    # drafter's block logits, KL(p_T || q_T) weighted by block offset.
    logits = np.asarray(target.module().logits(out.hidden), np.float64)  # [2, 20, V]
    block = np.full((2, 2, cfg.block_size), cfg.mask_token_id, np.int32)
    block[:, :, 0] = np.take_along_axis(np.asarray(tokens), anchors, axis=1)
    hidden = dt.block_hidden(drafter.module(), out.taps, target.module().model.embed_tokens(jnp.asarray(block)),
                             jnp.asarray(anchors))
    q_logits = np.asarray(target.module().logits(hidden), np.float64)  # [2, N, Bk, V]
    w = dt.loss_weights(cfg.block_size)
    total = 0.0
    for b in range(2):
        for n in range(2):
            for k in range(1, cfg.block_size):
                p = jax.nn.softmax(logits[b, anchors[b, n] + k - 1] / T)
                logq = jax.nn.log_softmax(q_logits[b, n, k] / T)
                total += w[k] * float(np.sum(p * (np.log(p) - logq)))
    np.testing.assert_allclose(float(loss), total / (4 * w.sum()), rtol=1e-4)


def test_continuations_sample_at_the_temperature_and_are_seeded():
    target = tiny_target()
    prompts = np.random.default_rng(1).integers(2, 64, (4, 6)).astype(np.int32)
    greedy = distil.continuations(target, prompts, 5, 0.0, batch=4, seed=0)
    hot = distil.continuations(target, prompts, 5, 1.0, batch=4, seed=0)
    assert greedy.shape == hot.shape == (4, 11) and (greedy[:, :6] == prompts).all()
    np.testing.assert_array_equal(hot, distil.continuations(target, prompts, 5, 1.0, batch=4, seed=0))
    assert (hot[:, 6:] != greedy[:, 6:]).any()  # a near-uniform random target: samples leave the argmax path
