"""The Gated DeltaNet verify as a Pallas TPU (Mosaic) kernel (dflash_jax/kernels/gdn_tpu.py): numerics in interpret mode
against the token-by-token recurrence (chain) and the XLA tree form, its HBM traffic from its block specs, and
compiled by libtpu for a compile-only v5p chip at Qwen3.5-35B-A3B's verify shapes."""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_gdn import assert_close, make_inputs

from dflash_jax.kernels import gdn
from dflash_jax.kernels.gdn_tpu import traffic

F32, BF16 = jnp.float32, jnp.bfloat16


def _tpu_verify(*args, **kw):
    return gdn.gdn_verify(*args, impl="tpu-interpret", **kw)


@pytest.mark.parametrize("T, Hk, Hv, D, dtype", [
    (16, 1, 2, 32, BF16),
    pytest.param(16, 2, 6, 16, F32, marks=pytest.mark.slow),
    pytest.param(5, 1, 3, 16, F32, marks=pytest.mark.slow),
    pytest.param(1, 2, 2, 16, F32, marks=pytest.mark.slow),
])
def test_verify_matches_the_recurrence_in_interpret_mode(T, Hk, Hv, D, dtype):
    """o and the writes u of a chain of T tokens (two rows, value heads sharing key heads) against the token scan."""
    args = make_inputs(2, T, Hk, Hv, D, D, dtype, seed=T + 7)
    assert_close(_tpu_verify(*args), jax.jit(gdn.gdn_verify_reference)(*args))


def _random_tree(rng, B, T):
    """[B, T, T] bool: row t marks t's ancestors and t (parents drawn before their children)."""
    mask = np.zeros((B, T, T), bool)
    for b in range(B):
        for t in range(T):
            mask[b, t, t] = True
            if t:
                mask[b, t] |= mask[b, rng.integers(0, t)]
    return mask


@pytest.mark.parametrize("by_depth", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_tree_matches_the_xla_tree_form(by_depth):
    """A draft tree (every token along its own root -> token path) against ``_verify_block``'s tree form, solved
    by depth rounds (a draft tree's static depth) or by the inverse; one round short must differ (slow case)."""
    rng = np.random.default_rng(11)
    B, T = 2, 12
    q, k, *rest = make_inputs(B, T, 1, 2, 16, 16, F32, seed=3)
    k = k[:, :1] + 0.3 * k  # near-repeated keys: the writes interact strongly along a path
    args = (q, k / jnp.linalg.norm(k, axis=-1, keepdims=True), *rest)
    mask = _random_tree(rng, B, T)
    depth = int(mask.sum(-1).max()) - 1 if by_depth else None
    tree = jnp.asarray(mask)
    want = jax.jit(lambda *a: gdn._verify_block(*a, tree, depth))(*args)
    assert_close(_tpu_verify(*args, tree=tree, tree_depth=depth), want)
    if not by_depth:
        depth = int(mask.sum(-1).max()) - 1
        short = _tpu_verify(*args, tree=tree, tree_depth=depth - 1)
        assert np.abs(np.asarray(short[1]) - np.asarray(want[1])).max() > 1e-4


def _shapes(B, T, Hk, Hv, D=128):
    sds = jax.ShapeDtypeStruct
    qk = sds((B, T, Hk, D), F32)  # the layer hands over f32 q, k (after the L2 norm) and v in the model dtype
    return qk, qk, sds((B, T, Hv, D), BF16), sds((B, T, Hv), F32), sds((B, T, Hv), F32), sds((B, Hv, D, D), F32)


@pytest.mark.parametrize("model, Hk, Hv", [("27b", 16, 48), ("35b_a3b", 16, 32)])
@pytest.mark.parametrize("B", [1, 8])
def test_traffic_is_each_operand_once(model, Hk, Hv, B):
    """At the real shapes (T = 16) the block specs move every input and output exactly once: the state and the
    inputs once (the floor) plus o and u, <= 1.5x that floor; a tree adds its mask once per row."""
    args = _shapes(B, 16, Hk, Hv)
    nbytes = lambda x: int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize  # noqa: E731
    floor = sum(map(nbytes, args))
    outputs = 2 * nbytes(args[2]) * 2  # o, u f32
    assert traffic(*args) == floor + outputs <= 1.5 * floor
    assert traffic(*args, jnp.zeros((B, 16, 16), bool)) == floor + outputs + B * 16 * 16 * 4


def test_bad_tree_shape_is_refused():
    args = make_inputs(1, 4, 1, 1, 16, 16, F32)
    with pytest.raises(ValueError, match=r"tree must be \[B, T, T\]"):
        _tpu_verify(*args, tree=jnp.ones((1, 4, 5), bool))


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu not installed (jax[tpu])")
@pytest.mark.parametrize("Hk, Hv", [(8, 16), pytest.param(16, 32, marks=pytest.mark.slow)])
def test_compiles_for_a_tpu_chip(Hk, Hv):
    """libtpu compiles the kernel for a v5p chip (batch 1, T = 16, heads of 128; the slow case at 35B-A3B's 16 / 32
    heads): one Mosaic call, no HBM temporaries (no relayout copies around it), and the op's bytes are the block
    specs' traffic (35B-A3B: 3.02 MB, where the XLA form accessed 30.1 MB)."""
    from dflash_jax.perf import compile_report

    one = jax.sharding.SingleDeviceSharding(compile_report.tpu_devices("v5p:2x2x1")[0])
    args = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one) for x in _shapes(1, 16, Hk, Hv)]
    compiled = jax.jit(lambda *a: gdn.gdn_verify(*a, impl="tpu")).lower(*args).compile()
    assert compiled.as_text().count("tpu_custom_call") == 1
    assert compiled.memory_analysis().temp_size_in_bytes == 0
    assert compiled.cost_analysis()["bytes accessed"] == traffic(*args)


def test_on_a_mesh_outside_shard_map_the_xla_form_runs():
    """Traced under a mesh of several devices (not in a shard_map body) a Mosaic call cannot be partitioned (JAX
    refuses to compile it), so the verify there runs the XLA form (said once in the log); under no mesh, the kernel."""
    args = make_inputs(1, 4, 1, 1, 16, 16, F32)
    calls = lambda: str(jax.make_jaxpr(lambda *a: _tpu_verify(*a, tree=jnp.tril(jnp.ones((1, 4, 4), bool))))(*args))  # noqa: E731
    assert "pallas_call" in calls()
    mesh = jax.sharding.AbstractMesh((2,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.sharding.use_abstract_mesh(mesh):
        assert "pallas_call" not in calls()
