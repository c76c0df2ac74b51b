"""Tests of the Gated DeltaNet Pallas kernels (dflash_jax/kernels/gdn.py) against their jnp references.

Numerics run the kernels on small shapes, compiled on a GPU and interpreted on a CPU (``pallas_mode``);
lowering for ROCm and CUDA runs at the real Qwen3.5 shapes of ``report_cases`` with abstract
arguments (no GPU needed).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_mode import INTERPRET, MODE

from dflash_jax.kernels import gdn

F32, BF16 = jnp.float32, jnp.bfloat16
RTOL = 1e-5  # all kernel math is f32; bf16 inputs are upcast identically by kernel and reference

verify_reference = jax.jit(gdn.gdn_verify_reference)
replay_reference = jax.jit(gdn.gdn_replay_reference)
chunked_reference = jax.jit(gdn.gdn_chunked_reference)


def make_inputs(B, T, Hk, Hv, Dk, Dv, dtype, seed=0):
    """Prepared GDN inputs as the layer hands them over: unit-norm k, Dk^-0.5-scaled unit q, g < 0.

    numpy draws them: eager jax.random would compile a program per shape, which dominates the runtime.
    """
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape, dtype=np.float32)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    q = unit(normal(B, T, Hk, Dk)) * Dk**-0.5
    k = unit(normal(B, T, Hk, Dk))
    v = normal(B, T, Hv, Dv)
    g = -0.5 * np.logaddexp(0.0, normal(B, T, Hv))  # -softplus/2
    beta = 1.0 / (1.0 + np.exp(-normal(B, T, Hv)))
    state = 0.3 * normal(B, Hv, Dk, Dv)
    return (*(jnp.asarray(x, dtype) for x in (q, k, v)), *(jnp.asarray(x, F32) for x in (g, beta, state)))


def assert_close(actual, expected):
    if isinstance(expected, tuple):
        assert isinstance(actual, tuple) and len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            assert_close(a, e)
        return
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    scale = np.abs(expected).max()
    np.testing.assert_allclose(actual, expected, rtol=0, atol=RTOL * scale)


# (T, Hk, Hv, Dv, block_v, dtype): T over {1, 5, 16}, Hv/Hk over {1, 2, 3}, one or several Dv tiles
STEP_CASES = [
    (1, 2, 2, 16, 32, F32),
    (5, 1, 3, 32, 16, BF16),
    (16, 2, 4, 32, 16, F32),
    (16, 1, 3, 16, 16, BF16),
]


@pytest.mark.parametrize("T, Hk, Hv, Dv, block_v, dtype", STEP_CASES)
def test_verify_matches_reference(T, Hk, Hv, Dv, block_v, dtype):
    args = make_inputs(2, T, Hk, Hv, 16, Dv, dtype, seed=T)
    blocks = gdn.RecurrentBlocks(block_v=block_v)
    assert_close(gdn.gdn_verify_pallas(*args, blocks=blocks, interpret=INTERPRET), verify_reference(*args))


@pytest.mark.parametrize("T, Hk, Hv, Dv, block_v, dtype", STEP_CASES)
def test_xla_verify_matches_the_token_scan(T, Hk, Hv, Dv, block_v, dtype):
    """The XLA path's verify (one chunk of the WY form) against the token-by-token recurrence."""
    args = make_inputs(2, T, Hk, Hv, 16, Dv, dtype, seed=T + 2)
    assert_close(jax.jit(lambda *a: gdn.gdn_verify(*a, impl="reference"))(*args), verify_reference(*args))


def _recurrence_state(k, v, g, beta, state, n):
    """The oracle: row b's state after running the token recurrence on its first n[b] tokens alone."""
    rows = []
    for b, nb in enumerate(np.asarray(n)):
        one = [x[b:b + 1, :nb] for x in (k, v, g, beta)]
        rows.append(gdn.gdn_recurrent_reference(one[0], *one, state[b:b + 1])[1][0] if nb else state[b])
    return jnp.stack(rows)


@pytest.mark.parametrize("T, Hk, Hv, Dv, block_v, dtype", STEP_CASES)
def test_replay_of_the_verify_writes_is_the_recurrence_on_the_kept_tokens(T, Hk, Hv, Dv, block_v, dtype):
    """Closed-form replay (XLA path and Pallas kernel) against the token recurrence run on only the
    first n tokens, with ragged n (0, part, all)."""
    q, k, v, g, beta, state = make_inputs(3, T, Hk, Hv, 16, Dv, dtype, seed=T + 1)
    n = jnp.array([0, T // 2, T], jnp.int32)
    _, u = verify_reference(q, k, v, g, beta, state)
    want = _recurrence_state(k, v, g, beta, state, n)
    assert_close(replay_reference(k, u, g, state, n), want)
    blocks = gdn.RecurrentBlocks(block_v=block_v)
    assert_close(gdn.gdn_replay_pallas(k, u, g, state, n, blocks=blocks, interpret=INTERPRET), want)


def test_replay_keeps_the_state_exactly_when_nothing_is_kept():
    """n = 0 (a finished row, or every draft rejected before the anchor) changes no bit on the XLA path."""
    q, k, v, g, beta, state = make_inputs(2, 16, 2, 4, 16, 32, F32, seed=9)
    _, u = verify_reference(q, k, v, g, beta, state)
    new = replay_reference(k, u, g, state, jnp.zeros((2,), jnp.int32))
    np.testing.assert_array_equal(np.asarray(new), np.asarray(state))


def test_dispatch_runs_the_kernels():
    """(gdn_replay dispatch is exercised by test_replay_commit_is_bit_exact.)"""
    q, k, v, g, beta, state = make_inputs(1, 3, 1, 2, 16, 16, F32)
    o = gdn.gdn_verify(q, k, v, g, beta, state, impl=MODE)
    oc, sc = gdn.gdn_chunked(q, k, v, g, beta, state, impl=MODE)
    assert_close(o, verify_reference(q, k, v, g, beta, state))
    ref_o, ref_s = chunked_reference(q, k, v, g, beta, state)
    assert_close(oc, ref_o)
    assert_close(sc, ref_s)


def test_replay_commit_is_bit_exact():
    """The kernel: n = 0 keeps the state; replaying n of 16 tokens equals replaying just those n tokens."""
    q, k, v, g, beta, state = make_inputs(3, 16, 2, 4, 16, 32, BF16, seed=7)
    u = verify_reference(q, k, v, g, beta, state)[1]
    n = jnp.array([0, 7, 16], jnp.int32)
    replay = lambda *a: np.asarray(gdn.gdn_replay(*a, impl=MODE))
    full = replay(k, u, g, state, n)
    np.testing.assert_array_equal(full[0], np.asarray(state[0]))
    for b in (1, 2):
        nb = int(n[b])
        rows = [x[b:b + 1, :nb] for x in (k, u, g)]
        alone = replay(*rows, state[b:b + 1], n[b:b + 1])
        np.testing.assert_array_equal(full[b], alone[0])


# (T, Hk, Hv, dtype): T crosses the chunk size of 64 (and is padded when not a multiple of it)
CHUNKED_CASES = [(1, 1, 1, F32), (17, 1, 2, BF16), (64, 2, 6, F32), (100, 1, 3, BF16)]


@pytest.mark.parametrize("T, Hk, Hv, dtype", CHUNKED_CASES)
def test_chunked_matches_reference(T, Hk, Hv, dtype):
    args = make_inputs(2, T, Hk, Hv, 32, 32, dtype, seed=T)
    blocks = gdn.ChunkedBlocks(block_v=16, block_k=16)  # two state tiles, each in two Dk slices
    o, state = gdn.gdn_chunked_pallas(*args, blocks=blocks, interpret=INTERPRET)
    ref_o, ref_state = chunked_reference(*args)
    assert_close(o, ref_o)
    assert_close(state, ref_state)


CASES = gdn.report_cases()


def test_report_cases_cover_the_shipped_shapes():
    names = [c.name for c in CASES]
    assert len(set(names)) == len(names)
    for kernel in ("gdn_verify", "gdn_replay"):
        for model in ("27b", "35b_a3b"):
            for B in (1, 32):
                assert f"{kernel}/{model}/b{B}/t16" in names
    assert {"gdn_chunked/27b/b1/t4096", "gdn_chunked/35b_a3b/b1/t4096"} <= set(names)
    assert all(c.bytes_moved > 0 and isinstance(c.args[0], jax.ShapeDtypeStruct) for c in CASES)


@pytest.mark.parametrize("platform", ["rocm", "cuda"])
@pytest.mark.parametrize("case", [c for c in CASES if c.name.startswith("gdn_") and "/27b/" in c.name],
                         ids=lambda c: c.name)
def test_lowers_to_triton_at_real_shapes(case, platform):
    lowered = jax.jit(case.fn).trace(*case.args).lower(lowering_platforms=(platform,))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()


def _abstract(B=1, T=4, Hk=2, Hv=4, D=16):
    sds = jax.ShapeDtypeStruct
    return dict(q=sds((B, T, Hk, D), BF16), k=sds((B, T, Hk, D), BF16), v=sds((B, T, Hv, D), BF16),
                g=sds((B, T, Hv), F32), beta=sds((B, T, Hv), F32), state=sds((B, Hv, D, D), F32))


@pytest.mark.parametrize("arg, shape, match", [
    ("q", (1, 4, 2, 32), "q must have k's shape"),
    ("v", (1, 3, 4, 16), "v must be"),
    ("v", (1, 4, 3, 16), "must be a multiple of key heads"),
    ("g", (1, 4, 2), "g must be"),
    ("beta", (4, 4), "beta must be"),
    ("state", (1, 4, 16, 32), "state must be"),
])
def test_bad_shapes_raise(arg, shape, match):
    args = _abstract()
    args[arg] = jax.ShapeDtypeStruct(shape, args[arg].dtype)
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(lambda a: gdn.gdn_verify(**a, impl="pallas"), args)
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(lambda a: gdn.gdn_chunked(**a, impl="pallas"), args)
    if arg not in ("q", "beta"):
        replay = dict(k=args["k"], u=args["v"], g=args["g"], state=args["state"])
        n = jax.ShapeDtypeStruct((1,), jnp.int32)
        with pytest.raises(ValueError, match=match.replace("v must", "u must")):
            jax.eval_shape(lambda a: gdn.gdn_replay(**a, n=n, impl="pallas"), replay)


def test_bad_n_and_head_dim_raise():
    args = _abstract()
    args = dict(k=args["k"], u=args["v"], g=args["g"], state=args["state"])
    with pytest.raises(ValueError, match=r"n must be \[B\]"):
        jax.eval_shape(lambda a: gdn.gdn_replay(**a, n=jax.ShapeDtypeStruct((2,), jnp.int32), impl="pallas"),
                       args)
    args = _abstract(D=24)
    with pytest.raises(ValueError, match="power of two"):
        jax.eval_shape(lambda a: gdn.gdn_verify(**a, impl="pallas"), args)


def test_block_sizes_must_be_powers_of_two():
    with pytest.raises(ValueError, match="block_v = 24"):
        gdn.RecurrentBlocks(block_v=24)
    with pytest.raises(ValueError, match="chunk = 48"):
        gdn.ChunkedBlocks(chunk=48)


@pytest.mark.parametrize("T", [1, 17, 64, 100])
def test_chunked_form_equals_token_recurrence(T):
    """The WY/UT chunked form (prefill) and the token-by-token recurrence (verify) are the same rule."""
    args = make_inputs(2, T, 1, 3, 16, 16, F32, seed=100 + T)
    o, state = chunked_reference(*args)
    ref_o, ref_state = gdn.gdn_recurrent_reference(*args)
    np.testing.assert_allclose(o, ref_o, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(state, ref_state, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("C", [1, 48, 64])
@pytest.mark.parametrize("repeated", [False, True], ids=["random", "repeated"])
def test_reference_unit_lower_inverse_matches_numpy(C, repeated):
    """The chunked reference's LAPACK-free (I + A)^-1 equals numpy's f64 inverse to f32 round-off, also on a
    chunk of near-identical keys, where A is all ~beta below the diagonal (a Neumann product loses every digit)."""
    rng = np.random.default_rng(C)
    k = rng.standard_normal((3, C, 16)) + (5.0 if repeated else 0.0)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    a = 0.95 * np.tril(k @ np.swapaxes(k, -1, -2), -1)
    exact = np.linalg.inv(np.eye(C) + a)
    got = np.asarray(gdn._unit_lower_inverse_xla(jnp.asarray(a, F32)), np.float64)
    np.testing.assert_allclose(got, exact, rtol=0, atol=2e-6 * np.abs(exact).max())
