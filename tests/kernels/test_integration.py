"""The whole target and drafter with the Pallas kernels (compiled on a GPU, interpreted on a CPU:
``pallas_mode``) equal the jnp reference path."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from pallas_mode import MODE

from dflash_jax.config import DrafterConfig
from dflash_jax.models import drafter as dr
from dflash_jax.models.target import Target, load_target


def _close(a, b, atol=2e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), atol=atol, rtol=1e-4)


def _target_steps(tg, tokens):
    """Prefill (chunked GDN, chunked attention), a 16-token verify and a ragged commit."""
    out, cache = tg.prefill(tokens[:, :20], [20, 9], capacity=48, taps=(0, 2))
    ver, vcache = tg.verify(tokens[:, 20:36], cache, taps=(0, 2))
    return out, ver, Target.commit(vcache, [5, 16])


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_target_with_kernels_equals_reference(kind, request):
    _, path = request.getfixturevalue(f"hf_{kind}")
    tg = load_target(path, dtype=jnp.float32, kernels="reference", progress=False)
    tokens = np.random.default_rng(0).integers(0, tg.cfg.vocab_size, (2, 36)).astype(np.int32)
    assert tg.kernels == "reference"
    ref = _target_steps(tg, tokens)
    got = _target_steps(tg.with_kernels(MODE), tokens)
    _close(got, ref)


@pytest.mark.parametrize("layer_types", [("full_attention", "full_attention"), ("sliding_attention", "full_attention")])
def test_drafter_with_kernels_equals_reference(layer_types):
    cfg = DrafterConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, intermediate_size=48, vocab_size=96, block_size=8, mask_token_id=95,
                           target_layer_ids=(0, 2), num_target_layers=4, layer_types=layer_types,
                           sliding_window=6)
    drafter = dr.init_drafter(cfg, seed=1, kernels="reference")
    rng = np.random.default_rng(2)
    taps = jnp.asarray(rng.normal(size=(2, 12, 64)), jnp.float32)
    block = jnp.asarray(rng.normal(size=(2, 8, 32)), jnp.float32)

    def run(drafter):
        model = drafter.module()
        cache = dr.advance(dr.write_context(model, dr.init_draft_cache(cfg, 2, 32, jnp.float32), taps),
                           jnp.array([12, 7]))
        return dr.draft_block(model, cache, block)

    ref = run(drafter)
    got = run(drafter.with_kernels(MODE))
    _close(got, ref)


def test_kernel_mode_is_static_graph_state(hf_dense):
    """The mode lives in the graphdef: equal modes share a jit cache entry, another mode retraces."""
    _, path = hf_dense
    tg = load_target(path, dtype=jnp.float32, progress=False)
    traces = []

    @functools.partial(jax.jit, static_argnums=0)
    def embed(graphdef, params, tokens):
        traces.append(nnx.merge(graphdef, params).kernels)
        return nnx.merge(graphdef, params).model.embed_tokens(tokens)

    tokens = jnp.zeros((1, 2), jnp.int32)
    for t in (tg, tg.with_kernels("reference"), tg.with_kernels("interpret"), tg.with_kernels("interpret")):
        embed(t.graphdef, t.params, tokens)
    assert traces == ["reference", "interpret"]
    modes = {m.kernels for _, m in nnx.iter_modules(tg.with_kernels("interpret").module()) if hasattr(m, "kernels")}
    assert modes == {"interpret"}
    with pytest.raises(ValueError, match="unknown kernel mode 'cuda'"):
        tg.with_kernels("cuda")
