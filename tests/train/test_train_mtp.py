"""train/mtp.py: the unrolled MTP loss runs the head exactly as ``MTPProposer`` drafts with it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax import kernels
from dflash_jax.decoding.mtp import mtp_step
from dflash_jax.decoding.proposers import TargetView
from dflash_jax.models.cache import position_table
from dflash_jax.models.target import Qwen35ForCausalLM, forward
from dflash_jax.train import lm
from dflash_jax.train import mtp as mtrain


def _ce(logits, label) -> float:
    return float(jax.nn.logsumexp(logits) - logits[label])


def test_unrolled_loss_equals_drafting_from_a_cache_of_the_context_only():
    """Step k >= 2 of a chain anchored at t must see the step-1 entries 0..t and its own chain, nothing after t:
    recomputed here as drafting does it, from a fresh cache holding only the context, one mtp_step per draft."""
    cfg = lm.small_config(vocab_size=64, eos_id=0, hidden=32, layers=4, intermediate=64, heads=2, kv_heads=1,
                          head_dim=16, linear_key_heads=1, linear_value_heads=2, linear_head_dim=16)
    model = Qwen35ForCausalLM(cfg, dtype=jnp.float32, mtp=True, rngs=nnx.Rngs(0))
    graphdef, mtp_params, rest = nnx.split(model, nnx.PathContains("mtp"), ...)
    B, L, P, K = 2, 20, 5, 4
    tokens = np.random.default_rng(0).integers(2, 64, (B, L)).astype(np.int32)
    hidden = np.asarray(forward(nnx.graphdef(model), nnx.state(model), jnp.asarray(tokens)).hidden)
    anchors = np.array([[4, 9, 13], [6, 7, 14]], np.int32)  # in [P - 1, L - K - 2]
    batch = {"tokens": jnp.asarray(tokens), "hidden": jnp.asarray(hidden), "anchors": jnp.asarray(anchors)}
    loss, metrics = jax.jit(mtrain.mtp_loss_fn(graphdef, P, K))(mtp_params, rest, batch)
    assert set(metrics) == {f"acc{k}" for k in range(1, K + 1)}

    view, tab = TargetView.of(nnx.state(model)), position_table(cfg, L + K)
    step = jax.jit(lambda tok, h, kc, vc, start: mtp_step(model.mtp, view, tok, h, kc, vc, start, tab))
    deep = []  # [chains, K - 1] CE of drafts 2..K
    for b in range(B):
        for t in anchors[b]:
            kc, vc = kernels.empty_cache(1, L + K, cfg.num_key_value_heads, cfg.head_dim, jnp.float32)
            out, kc, vc = step(jnp.asarray(tokens[b:b + 1, 1:t + 2]), jnp.asarray(hidden[b:b + 1, :t + 1]), kc, vc,
                               jnp.zeros((1,), jnp.int32))
            h, row = out[:, -1:], []
            for k in range(2, K + 1):
                h, kc, vc = step(jnp.asarray(tokens[b:b + 1, t + k:t + k + 1]), h, kc, vc, jnp.asarray([t + k - 1]))
                row.append(_ce(view.logits(h[0, 0]), tokens[b, t + k + 1]))
            deep.append(row)
    kc, vc = kernels.empty_cache(B, L + K, cfg.num_key_value_heads, cfg.head_dim, jnp.float32)
    out, _, _ = step(jnp.asarray(tokens[:, 1:]), jnp.asarray(hidden[:, :-1]), kc, vc, jnp.zeros((B,), jnp.int32))
    first = np.mean([_ce(view.logits(out[b, t]), tokens[b, t + 2]) for b in range(B) for t in range(P - 2, L - 2)])
    expected = (first + np.mean(deep, axis=0).sum()) / K
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)


def test_unroll_one_is_the_teacher_forced_loss():
    cfg = lm.small_config(vocab_size=64, eos_id=0, hidden=32, layers=4, intermediate=64, heads=2, kv_heads=1,
                          head_dim=16, linear_key_heads=1, linear_value_heads=2, linear_head_dim=16)
    model = Qwen35ForCausalLM(cfg, dtype=jnp.float32, mtp=True, rngs=nnx.Rngs(1))
    graphdef, mtp_params, rest = nnx.split(model, nnx.PathContains("mtp"), ...)
    tokens = np.random.default_rng(1).integers(2, 64, (2, 16)).astype(np.int32)
    hidden = forward(nnx.graphdef(model), nnx.state(model), jnp.asarray(tokens)).hidden
    batch = {"tokens": jnp.asarray(tokens), "hidden": hidden, "anchors": jnp.zeros((2, 1), jnp.int32)}
    loss, metrics = mtrain.mtp_loss_fn(graphdef, 4, 1)(mtp_params, rest, batch)
    assert set(metrics) == {"acc1"} and np.isfinite(float(loss))
