"""Grouped (per-expert) matmul: the Pallas kernel (compiled on a GPU, interpreted on a CPU: ``pallas_mode``)
against the ragged_dot reference, lowering at Qwen3.5-35B-A3B shapes for ROCm and CUDA, and shape errors; the
TPU (Mosaic) form interpreted against the reference, its schedule, compiled for a TPU chip, and the MoE target
in the TPU mode against transformers."""

from __future__ import annotations

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_mode import INTERPRET, MODE

from dflash_jax.kernels import moe


def _case(group_sizes, trailing, dtype, din=64, dout=32, seed=0):
    rng = np.random.default_rng(seed)
    gs = np.asarray(group_sizes, np.int32)
    M = int(gs.sum()) + trailing
    x = jnp.asarray(rng.standard_normal((M, din)), dtype)
    w = jnp.asarray(rng.standard_normal((len(gs), dout, din)) / np.sqrt(din), dtype)
    return x, w, jnp.asarray(gs)


# E=8: empty groups, groups shorter and longer than the 16-row tile (17 straddles two tiles), a group
# of exactly one tile, and rows past sum(group_sizes) that must come out zero. The f32 case uses small
# blocks so the Din loop takes 4 steps and Dout has 2 column tiles; the last case has M = 9 < one tile.
_GROUPS = [3, 0, 17, 1, 0, 16, 5, 2]


@pytest.mark.parametrize("dtype,group_sizes,trailing,blocks", [
    (jnp.float32, _GROUPS, 7, moe.GroupedBlocks(block_out=16, block_in=16)),
    (jnp.bfloat16, _GROUPS, 7, None),
    (jnp.float32, [0, 2, 0, 0, 3, 0, 0, 0], 4, None),
])
def test_kernel_matches_reference(dtype, group_sizes, trailing, blocks):
    x, w, gs = _case(group_sizes, trailing, dtype)
    if blocks is None:  # through the dispatcher, default blocks
        got = moe.grouped_matmul(x, w, gs, impl=MODE)
    else:
        got = moe.grouped_matmul_pallas(x, w, gs, blocks=blocks, interpret=INTERPRET)
    want = moe.grouped_matmul_reference(x, w, gs)
    assert got.dtype == x.dtype and got.shape == (x.shape[0], w.shape[1])
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
    assert not np.any(np.asarray(got[x.shape[0] - trailing:], np.float32))


def test_tile_table_covers_every_row_once():
    gs = jnp.asarray([3, 0, 17, 1, 0, 16, 5, 2], jnp.int32)
    M = int(gs.sum()) + 7
    expert, first, end = np.asarray(jax.jit(moe._tile_table, static_argnums=(1, 2))(gs, M, 16))
    owner = np.full(M, -2)
    for e, f, t in zip(expert, first, end, strict=True):
        assert t - f <= 16 and np.all(owner[f:t] == -2)
        owner[f:t] = e
    assert np.array_equal(owner, np.concatenate([np.repeat(np.arange(8), np.asarray(gs)), np.full(7, -1)]))


@pytest.mark.parametrize("platform", ["rocm", "cuda"])
def test_lowers_at_35b_a3b_shapes(platform):
    for case in moe.report_cases():
        text = jax.jit(case.fn).trace(*case.args).lower(lowering_platforms=(platform,)).as_text()
        assert "triton" in text, case.name


@pytest.mark.parametrize("x_shape,w_shape,gs_shape,gs_dtype,match", [
    ((16,), (8, 32, 64), (8,), jnp.int32, "x must be"),
    ((16, 64), (8, 32, 48), (8,), jnp.int32, "w must be"),
    ((16, 64), (8, 32, 64), (7,), jnp.int32, "group_sizes must be"),
    ((16, 64), (8, 32, 64), (8,), jnp.float32, "group_sizes must be"),
    ((16, 64), (8, 48, 64), (8,), jnp.int32, "multiples of block_out"),
])
def test_bad_shapes_raise(x_shape, w_shape, gs_shape, gs_dtype, match):
    args = (jnp.zeros(x_shape, jnp.float32), jnp.zeros(w_shape, jnp.float32), jnp.zeros(gs_shape, gs_dtype))
    with pytest.raises(ValueError, match=match):
        moe.grouped_matmul(*args, impl=MODE)


# ---------------------------------------------------------------------------------------------
# The TPU (Mosaic) form: interpreted here against the reference; compiled for a compile-only TPU chip

@pytest.mark.parametrize("dtype,group_sizes,trailing", [
    (jnp.float32, _GROUPS, 7), (jnp.bfloat16, _GROUPS, 7), (jnp.float32, [0, 2, 0, 0, 3, 0, 0, 0], 4),
    (jnp.bfloat16, [1] * 8, 0), (jnp.float32, [0] * 8, 5)])
def test_tpu_kernel_matches_reference_in_interpret_mode(dtype, group_sizes, trailing):
    x, w, gs = _case(group_sizes, trailing, dtype, din=256, dout=256)
    got = moe.grouped_matmul_tpu(x, w, gs, interpret=True)
    want = moe.grouped_matmul_reference(x, w, gs)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
    assert not np.any(np.asarray(got[x.shape[0] - trailing:], np.float32))


def test_tpu_kernel_never_reads_an_expert_without_rows():
    """The experts no row picks hold NaN: a kernel that multiplied (hence fetched) any of them would spread it."""
    gs = np.asarray([0, 3, 0, 0, 17, 0, 1, 0], np.int32)
    x, w, _ = _case(gs, 0, jnp.float32, din=256, dout=256)
    poisoned = jnp.where(jnp.asarray(gs == 0)[:, None, None], jnp.nan, w)
    got = moe.grouped_matmul_tpu(x, poisoned, jnp.asarray(gs), interpret=True)
    want = moe.grouped_matmul_reference(x, jnp.where(jnp.asarray(gs == 0)[:, None, None], 0.0, w), jnp.asarray(gs))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group_sizes,trailing", [(_GROUPS, 7), ([0, 2, 0, 0, 3, 0, 0, 0], 4), ([0] * 8, 3)])
def test_tpu_visits_cover_each_row_once_and_fetch_each_expert_once(group_sizes, trailing):
    gs = np.asarray(group_sizes, np.int32)
    M, tm = int(gs.sum()) + trailing, 8
    expert, tile, start, end = np.asarray(moe.tpu_visits(jnp.asarray(gs), M, tm))
    assert len(expert) == -(-M // tm) + min(M, len(gs)) - 1  # the static bound
    owner = np.full(M, -1)
    for e, t, s, n in zip(expert, tile, start, end, strict=True):
        rows = np.arange(max(s, t * tm), min(n, (t + 1) * tm))
        assert np.all(owner[rows] == -1)
        owner[rows] = e
    assert np.array_equal(owner, np.concatenate([np.repeat(np.arange(len(gs)), gs), np.full(trailing, -1)]))
    assert np.all(np.diff(tile) >= 0)  # an output tile is revisited only by consecutive visits
    fetched = 1 + np.count_nonzero(np.diff(expert))  # the pipeline fetches a weight block when its expert changes
    assert fetched == max(1, np.count_nonzero(gs))


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu not installed (jax[tpu])")
def test_tpu_kernel_compiles_at_35b_a3b_decode_shapes_reading_eight_experts():
    """One decode token (8 rows) over 256 experts: the compiler's bytes are the 8 picked experts' (its cost is
    the kernel's own static bound, ``tpu_cost``), where the reference reads the whole stack (~3x)."""
    from dflash_jax.perf import compile_report

    one = jax.sharding.SingleDeviceSharding(compile_report.tpu_devices("v5p:2x2x1")[0])
    arg = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=one)  # noqa: E731
    E, Dout, Din, M = 256, 1024, 2048, 8
    floor = M * Dout * Din * 2
    args = arg((M, Din)), arg((E, Dout, Din)), arg((E,), jnp.int32)
    compiled = jax.jit(moe.grouped_matmul_tpu).lower(*args).compile()
    assert "tpu_custom_call" in compiled.as_text()
    assert floor <= compiled.cost_analysis()["bytes accessed"] <= 1.1 * floor
    reference = jax.jit(moe.grouped_matmul_reference).lower(*args).compile()
    assert reference.cost_analysis()["bytes accessed"] > E * Dout * Din * 2


def test_the_moe_target_in_the_tpu_mode_matches_transformers(hf_moe):
    """The whole MoE target with the TPU forms (kernels "tpu-interpret": the Mosaic kernels interpreted) against
    transformers: a decode token and a 16-token verify after a prompt."""
    from hf_oracle import hf_logits

    from dflash_jax.models import target
    from dflash_jax.models.target import load_target

    hf, path = hf_moe
    tg = load_target(path, dtype=jnp.float32, kernels="tpu-interpret", progress=False)
    assert tg.kernels == "tpu-interpret"
    tokens = np.random.default_rng(5).integers(0, tg.cfg.vocab_size, (1, 36)).astype(np.int32)
    want = hf_logits(hf, tokens)[0]
    _, cache = tg.prefill(tokens[:, :20], [20], capacity=64)
    for T in (1, 16):
        out, _ = tg.verify(tokens[:, 20:20 + T], jax.tree.map(jnp.copy, cache))  # verify donates the cache
        np.testing.assert_allclose(np.asarray(out.logits[0]), want[20:20 + T], atol=1e-4)
    # a prompt of more than _TPU_QUERIES tokens: the experts' rows gathered, counted per expert by comparison
    long = np.random.default_rng(6).integers(0, tg.cfg.vocab_size, (1, 72)).astype(np.int32)
    out, _ = tg.prefill(long, [72], capacity=128)
    np.testing.assert_allclose(np.asarray(out.logits[0]), hf_logits(hf, long)[0, -1], atol=1e-4)
    # the Mosaic kernels ran (the layers' bodies are traced once per kind): the experts' gate_up and down, the
    # attention kernel and the GDN verify
    jaxpr = str(jax.make_jaxpr(functools.partial(target.verify, tg.graphdef))(tg.params, tokens[:, 20:36], cache))
    assert jaxpr.count("pallas_call[") == 4 and "grouped_matmul_tpu" in jaxpr and "attention_tpu" in jaxpr
    assert "gdn_verify_tpu" in jaxpr
    # a draft tree's verify too: every node's logits are those of its root -> node path run alone as a chain
    parents = np.array([[-1, 0, 0, 1, 2, 3, 4, 1]], np.int32)
    nodes = tokens[:, 20:28]
    out, _ = tg.verify(nodes, jax.tree.map(jnp.copy, cache), parents=parents, tree_depth=3)
    for path in ([0, 1, 3, 5], [0, 2, 4, 6], [0, 1, 7]):
        alone, _ = tg.verify(nodes[:, path + [0] * (4 - len(path))], jax.tree.map(jnp.copy, cache))
        np.testing.assert_allclose(np.asarray(out.logits[0, path]), np.asarray(alone.logits[0, :len(path)]),
                                   atol=1e-4)
