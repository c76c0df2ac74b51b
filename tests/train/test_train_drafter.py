"""train/drafter.py: the DFlash training forward pinned to the inference decoder, its masks, loss and labels."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from train_fixtures import tiny_target

from dflash_jax.config import DrafterConfig
from dflash_jax.models import drafter as dr
from dflash_jax.models.target import forward
from dflash_jax.train import drafter as dt


@functools.cache
def _drafter_setup(layer_types=("full_attention", "full_attention"), window=None):
    target = tiny_target()
    cfg = dt.drafter_config(target.cfg, num_layers=2, taps=(0, 2), mask_token_id=1, block_size=8, heads=2,
                            kv_heads=1, head_dim=16, intermediate=64)
    cfg = DrafterConfig(**{**cfg.__dict__, "layer_types": layer_types, "sliding_window": window})
    drafter = dr.init_drafter(cfg, seed=3)
    tokens = jnp.asarray(np.random.default_rng(0).integers(2, 64, (1, 24)), jnp.int32)
    taps = jax.jit(lambda p, x: forward(target.graphdef, p, x, taps=cfg.target_layer_ids).taps)(
        target.params, tokens)  # [1, 24, 64]
    return target, cfg, drafter, tokens, taps


def _blocks(cfg, tokens, anchors):
    block = np.full((1, len(anchors), cfg.block_size), cfg.mask_token_id, np.int32)
    block[0, :, 0] = np.asarray(tokens)[0, anchors]
    return jnp.asarray(block)


@pytest.mark.parametrize("layer_types,window", [pytest.param(("full_attention", "full_attention"), None,
                                                             marks=pytest.mark.slow),  # the next has a full layer too
                                                (("full_attention", "sliding_attention"), 8)])
def test_training_forward_equals_inference_path(layer_types, window):
    target, cfg, drafter, tokens, taps = _drafter_setup(layer_types, window)
    model, tmod = drafter.module(), target.module()
    anchors = np.array([5, 11, 16])
    block = _blocks(cfg, tokens, anchors)
    trained = dt.block_hidden(model, taps, tmod.model.embed_tokens(block), jnp.asarray(anchors[None], jnp.int32))
    for n, a in enumerate(anchors):
        cache = dr.init_draft_cache(cfg, 1, 64, jnp.float32)
        cache = dr.advance(dr.write_context(model, cache, taps[:, :a]), a)
        hidden, _ = dr.draft_block(model, cache, tmod.model.embed_tokens(block[:, n]))
        np.testing.assert_allclose(np.asarray(trained[:, n]), np.asarray(hidden), atol=1e-5)


def test_anchor_mask_is_strict():
    target, cfg, drafter, tokens, taps = _drafter_setup()
    model, emb = drafter.module(), target.module().model.embed_tokens
    anchors = jnp.asarray([[9]], jnp.int32)
    x = emb(_blocks(cfg, tokens, [9]))
    base = dt.block_hidden(model, taps, x, anchors)
    own = dt.block_hidden(model, taps.at[:, 9:].add(1.0), x, anchors)  # the anchor's tap and everything after
    np.testing.assert_array_equal(np.asarray(base), np.asarray(own))
    before = dt.block_hidden(model, taps.at[:, 8].add(1.0), x, anchors)
    assert np.abs(np.asarray(before - base)).max() > 1e-4


def test_blocks_do_not_see_each_other():
    target, cfg, drafter, tokens, taps = _drafter_setup()
    model, emb = drafter.module(), target.module().model.embed_tokens
    anchors = jnp.asarray([[5, 12]], jnp.int32)
    x = emb(_blocks(cfg, tokens, [5, 12]))
    base = dt.block_hidden(model, taps, x, anchors)
    other = dt.block_hidden(model, taps, x.at[:, 1].add(1.0), anchors)
    np.testing.assert_array_equal(np.asarray(base[:, 0]), np.asarray(other[:, 0]))


def test_loss_weights_and_same_position_labels():
    w = dt.loss_weights(16)
    assert w[0] == 0 and np.allclose(w[1:], np.exp(-np.arange(15) / 7.0))
    target, cfg, drafter, tokens, taps = _drafter_setup()
    anchors = np.array([[4, 10]], np.int32)
    loss, _ = dt.drafter_loss_fn(drafter.graphdef, target.graphdef, cfg)(
        drafter.params, target.params, {"tokens": tokens, "taps": taps, "anchors": anchors})
    tmod = target.module()
    hidden = dt.block_hidden(drafter.module(), taps, tmod.model.embed_tokens(_blocks(cfg, tokens, anchors[0])),
                             jnp.asarray(anchors))
    logp = jax.nn.log_softmax(tmod.logits(hidden), -1)[0]  # [N, Bk, V]
    labels = np.asarray(tokens)[0, anchors[0][:, None] + np.arange(cfg.block_size)]  # block offset k -> a + k
    ce = -np.take_along_axis(np.asarray(logp), labels[..., None], -1)[..., 0]
    wk = dt.loss_weights(cfg.block_size)
    np.testing.assert_allclose(float(loss), (ce * wk).sum() / (2 * wk.sum()), rtol=1e-5)


def _dflash2_setup():
    target, cfg, _, tokens, taps = _drafter_setup()
    cfg = DrafterConfig(**{**cfg.__dict__, "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8,
                           "selector_top_k": 4})
    return target, cfg, dr.init_drafter(cfg, seed=3), tokens, taps


def test_dflash2_training_forward_equals_inference_path_and_trains_every_part():
    """The convolutions run inside the shared ``draft_block`` (each block convolved alone); the loss adds the
    selector's CE over every token's score with the true previous token as predecessor (the anchor at offset
    1), recomputed here from the selector's own pair term; every DFlash2 weight gets a gradient."""
    target, cfg, drafter, tokens, taps = _dflash2_setup()
    assert dt.drafter_config(target.cfg, num_layers=2, taps=(0, 2), mask_token_id=1, arch="dflash2").dflash2
    model, tmod = drafter.module(), target.module()
    anchors = np.array([[4, 10]], np.int32)
    block = _blocks(cfg, tokens, anchors[0])
    trained = dt.block_hidden(model, taps, tmod.model.embed_tokens(block), jnp.asarray(anchors))
    for n, a in enumerate(anchors[0]):
        cache = dr.advance(dr.write_context(model, dr.init_draft_cache(cfg, 1, 64, jnp.float32), taps[:, :a]), a)
        np.testing.assert_allclose(np.asarray(trained[:, n]),
                                   np.asarray(dr.draft_block(model, cache, tmod.model.embed_tokens(block[:, n]))[0]),
                                   atol=1e-5)
    batch = {"tokens": tokens, "taps": taps, "anchors": anchors}
    loss_fn = dt.drafter_loss_fn(drafter.graphdef, target.graphdef, cfg)
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(drafter.params, target.params, batch)
    labels = np.asarray(tokens)[0, anchors[0][:, None] + np.arange(cfg.block_size)]  # [N, Bk]
    pred = np.concatenate([labels[:, :1], labels[:, :-1]], axis=1)
    logits = np.asarray(tmod.logits(trained))[0]  # [N, Bk, V]
    pair = np.asarray(model.candidate_selector.pair_term(
        trained[0], jnp.asarray(pred), jnp.broadcast_to(jnp.arange(cfg.vocab_size), pred.shape + (cfg.vocab_size,))))
    wk = dt.loss_weights(cfg.block_size)

    def ce(x):  # weighted CE of the labels under scores x [N, Bk, V]
        logp = x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)
        return (-np.take_along_axis(logp, labels[..., None], -1)[..., 0] * wk).sum() / (2 * wk.sum())

    np.testing.assert_allclose(float(loss), ce(logits) + ce(logits + pair), rtol=1e-4)
    assert 0 <= float(metrics["selector_acc"]) <= 1
    flat = {"/".join(map(str, p)): np.abs(np.asarray(v.get_value())).max() for p, v in nnx.to_flat_state(grads)}
    for part in ("layers/0/attention_conv/base_kernel", "layers/1/mlp_conv/kernel_projection/weight",
                 "candidate_selector/predecessor_codebook/weight", "candidate_selector/successor_codebook/weight",
                 "candidate_selector/hidden_projection/weight"):
        assert flat[part] > 0, part
