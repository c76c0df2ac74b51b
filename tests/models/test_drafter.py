"""The DFlash drafter against a float64 numpy transcription of its formulas, plus config and loading.

The numpy reference below is written from the equations (Qwen3 RMSNorm, rotate-half RoPE, GQA
softmax attention over [context ; block] with the per-layer masks, SwiGLU); it shares no code with
``dflash_jax``. Every case uses one tiny shape so each config compiles once; head_dim is 16 (not
smaller) so the same tests run through the Pallas attention kernel on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.config import ConfigError, DrafterConfig, TargetConfig
from dflash_jax.io import checkpoint
from dflash_jax.io.checkpoint import CheckpointError
from dflash_jax.models.drafter import (
    Drafter,
    advance,
    check_fits,
    draft_block,
    init_draft_cache,
    init_drafter,
    load_drafter,
    save_drafter,
    write_context,
)
from dflash_jax.models.target import Qwen35ForCausalLM, Target

BASE = dict(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=48, rms_norm_eps=1e-6,
            rope_theta=10000.0, vocab_size=96, block_size=4, num_target_layers=4,
            dflash_config=dict(mask_token_id=95, target_layer_ids=[0, 2]))
LENGTHS = np.array([5, 9])  # committed context per row
CTX_T, CAPACITY = 12, 24  # context written (rows past LENGTHS are stale and must be ignored), cache rows


def _cfg(**over) -> DrafterConfig:
    return DrafterConfig.from_hf({**BASE, **over})


def _drafter(cfg: DrafterConfig) -> Drafter:
    """Random weights with every norm weight moved off 1, so the norms are exercised."""
    d = init_drafter(cfg, seed=1)
    rng = np.random.default_rng(2)
    flat = [(p, v.replace(v.get_value() + 0.1 * rng.standard_normal(v.get_value().shape).astype(np.float32)))
            if "norm" in str(p[-2]) else (p, v) for p, v in nnx.to_flat_state(d.params)]
    return dataclasses.replace(d, params=nnx.from_flat_state(flat))


@functools.partial(jax.jit, static_argnums=0)
def _write(graphdef, params, cache, taps):
    return write_context(nnx.merge(graphdef, params), cache, taps)


@functools.partial(jax.jit, static_argnums=0)
def _draft(graphdef, params, cache, x):
    return draft_block(nnx.merge(graphdef, params), cache, x)


def _inputs(cfg, seed=0):
    rng = np.random.default_rng(seed)
    taps = rng.standard_normal((2, CTX_T, len(cfg.target_layer_ids) * cfg.target_hidden_size)).astype(np.float32)
    x = rng.standard_normal((2, cfg.block_size, cfg.hidden_size)).astype(np.float32)
    return taps, x


def _run(d: Drafter, taps, x, lengths=LENGTHS):
    cache = init_draft_cache(d.cfg, 2, CAPACITY, jnp.float32)
    cache = advance(_write(d.graphdef, d.params, cache, jnp.asarray(taps)), jnp.asarray(lengths, jnp.int32))
    return _draft(d.graphdef, d.params, cache, jnp.asarray(x))


# ---- float64 numpy reference ----

def _np_params(d: Drafter) -> dict[str, np.ndarray]:
    return {".".join(map(str, p)): np.asarray(v.get_value(), np.float64) for p, v in nnx.to_flat_state(d.params)}


def _rms(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps))


def _rope(x, pos, theta):  # x [T, heads, H], pos [T]
    H = x.shape[-1]
    ang = pos[:, None] * theta ** (-np.arange(0, H, 2) / H)[None, :]  # [T, H/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., :H // 2], x[..., H // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _reference_row(cfg: DrafterConfig, P, taps, x, n_ctx, first=0):
    """Block hidden states of one row with n_ctx committed context tokens, of which only those at positions
    [first, n_ctx) are given (a truncated context keeps its positions)."""
    eps, N, K, H, Bk = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, len(x)
    c = _rms(taps[first:n_ctx] @ P["fc.weight"].T, P["hidden_norm.weight"], eps)
    pos_ctx, pos_blk = np.arange(first, n_ctx), n_ctx + np.arange(Bk)
    for i in range(cfg.num_hidden_layers):
        w = lambda name, i=i: P[f"layers.{i}.{name}.weight"]
        h = _rms(x, w("input_layernorm"), eps)
        q = _rope(_rms((h @ w("self_attn.q_proj").T).reshape(Bk, N, H), w("self_attn.q_norm"), eps),
                  pos_blk, cfg.rope_theta)
        src = np.concatenate([c, h])  # context keys come from the fused taps, block keys from the block
        k = _rope(_rms((src @ w("self_attn.k_proj").T).reshape(-1, K, H), w("self_attn.k_norm"), eps),
                  np.concatenate([pos_ctx, pos_blk]), cfg.rope_theta)
        v = (src @ w("self_attn.v_proj").T).reshape(-1, K, H)
        kpos, qpos = np.concatenate([pos_ctx, pos_blk])[None, :], pos_blk[:, None]
        visible = np.ones((Bk, len(pos_ctx) + Bk), bool)
        if cfg.layer_causal(i):
            visible &= kpos <= qpos
        if cfg.layer_types[i] == "sliding_attention":
            visible &= np.abs(qpos - kpos) < cfg.sliding_window
        k, v = np.repeat(k, N // K, axis=1), np.repeat(v, N // K, axis=1)  # query head n uses kv head n // group
        s = np.einsum("qnh,knh->nqk", q, k) / np.sqrt(H)
        s = np.where(visible[None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        o = np.einsum("nqk,knh->qnh", p, v).reshape(Bk, N * H)
        x = x + o @ w("self_attn.o_proj").T
        h = _rms(x, w("post_attention_layernorm"), eps)
        g, u = h @ w("mlp.gate_proj").T, h @ w("mlp.up_proj").T
        x = x + (g / (1 + np.exp(-g)) * u) @ w("mlp.down_proj").T
    return _rms(x, P["norm.weight"], eps)


@pytest.mark.parametrize("over", [
    {},  # all full attention: bidirectional over context + block
    dict(layer_types=["sliding_attention", "full_attention"], sliding_window=3),  # causal + window 3, then full
    dict(layer_types=["sliding_attention", "full_attention"], sliding_window=6,
         dflash_config={**BASE["dflash_config"], "causal": False}),  # bidirectional sliding layer
], ids=["full", "sliding", "causal_false"])
def test_draft_block_matches_numpy_reference(over):
    cfg = _cfg(**over)
    d = _drafter(cfg)
    taps, x = _inputs(cfg)
    out, cache = _run(d, taps, x)
    np.testing.assert_array_equal(cache.lengths, LENGTHS)  # drafting commits nothing
    P = _np_params(d)
    for b, n in enumerate(LENGTHS):
        ref = _reference_row(cfg, P, taps[b].astype(np.float64), x[b].astype(np.float64), n)
        np.testing.assert_allclose(np.asarray(out[b]), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("over", [{}, pytest.param(dict(layer_types=["sliding_attention", "full_attention"],
                                                       sliding_window=3), marks=pytest.mark.slow)],
                         ids=["full", "sliding"])
def test_draft_window_sees_the_last_n_context_positions(over):
    """--draft-window 4 (the block size): row 0 (5 context tokens) and row 1 (9) draft as if their context were
    its last 4 tokens at their own positions (the numpy reference given only those); a window covering the
    context changes nothing. The cache holds NaN before the window, which must never be read."""
    cfg = _cfg(**over)
    d = _drafter(cfg)
    taps, x = _inputs(cfg)
    full, _ = _run(d, taps, x)
    wide = _drafter(dataclasses.replace(cfg, draft_window=CTX_T))  # the same weights (seeded), a bounded graph
    np.testing.assert_allclose(np.asarray(_run(wide, taps, x)[0]), np.asarray(full), atol=1e-6, rtol=1e-6)
    n = cfg.block_size
    bounded = _drafter(dataclasses.replace(cfg, draft_window=n))
    assert [bounded.cfg.layer_context(i) for i in range(2)] == ([n, n] if not over else [2, n])
    gone = np.arange(CTX_T)[None, :, None] < (LENGTHS - n)[:, None, None]  # [B, CTX_T, 1]: before the window
    out, _ = _run(bounded, np.where(gone, np.nan, taps), x)
    P = _np_params(d)
    for b, ctx in enumerate(LENGTHS):
        ref = _reference_row(cfg, P, taps[b].astype(np.float64), x[b].astype(np.float64), ctx, first=ctx - n)
        np.testing.assert_allclose(np.asarray(out[b]), ref, atol=1e-5, rtol=1e-5)
    assert not np.allclose(np.asarray(out[1]), np.asarray(full[1]), atol=1e-3)  # row 1 lost 5 of its 9 tokens


@pytest.mark.parametrize("window", [0, -3, 3, True])
def test_draft_window_below_the_block_is_an_error(window):
    with pytest.raises(ConfigError, match=f"draft window {window!r} must be an integer >= the drafter's block_size 4"):
        dataclasses.replace(_cfg(), draft_window=window)


def test_layer_causality_and_windows():
    cfg = _cfg(layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    assert [cfg.layer_causal(i) for i in range(2)] == [True, False]
    assert [cfg.layer_window(i) for i in range(2)] == [3, None]
    assert _cfg(is_causal=True).layer_causal(1) is True
    # is_causal: false wins over the layer type (and is not confused with an absent key).
    off = _cfg(layer_types=["sliding_attention", "full_attention"], sliding_window=4, is_causal=False)
    assert off.layer_causal(0) is False and off.layer_window(0) == 4


def test_context_in_two_pieces_equals_one_write():
    cfg = _cfg()
    d = _drafter(cfg)
    taps, x = _inputs(cfg, seed=3)
    taps = taps[:, :7]
    empty = init_draft_cache(cfg, 2, CAPACITY, jnp.float32)
    # Two verifies: 3 tokens all committed, then 4 tokens of which 2 are committed.
    pieces = advance(_write(d.graphdef, d.params, empty, jnp.asarray(taps[:, :3])), 3)
    pieces = advance(_write(d.graphdef, d.params, pieces, jnp.asarray(taps[:, 3:7])), jnp.array([2, 2]))
    # The single write reuses the parity tests' width (CTX_T): the 5 committed tokens, then stale rows.
    padded = np.concatenate([taps[:, :5], np.zeros((2, CTX_T - 5, taps.shape[2]), np.float32)], axis=1)
    whole = advance(_write(d.graphdef, d.params, empty, jnp.asarray(padded)), jnp.array([5, 5]))
    np.testing.assert_array_equal(pieces.lengths, [5, 5])
    for a, b in zip(pieces.k, whole.k, strict=True):  # [B, K, S, H]
        np.testing.assert_allclose(np.asarray(a[:, :, :5]), np.asarray(b[:, :, :5]), atol=1e-6)
    for a, b in zip(pieces.v, whole.v, strict=True):  # [B, K, H, S]
        np.testing.assert_allclose(np.asarray(a[..., :5]), np.asarray(b[..., :5]), atol=1e-6)
    out_pieces, _ = _draft(d.graphdef, d.params, pieces, jnp.asarray(x))
    out_whole, _ = _draft(d.graphdef, d.params, whole, jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(out_pieces), np.asarray(out_whole), atol=1e-6)


@pytest.mark.parametrize("L, n, ids", [
    (36, 5, [1, 9, 17, 25, 33]), (64, 5, [1, 16, 31, 46, 61]), (40, 5, [1, 10, 19, 28, 37]),
    (32, 5, [1, 8, 15, 22, 29]), (36, 1, [18]),
])
def test_default_target_layer_ids(L, n, ids):
    cfg = _cfg(num_hidden_layers=n, num_target_layers=L, dflash_config=dict(mask_token_id=95))
    assert cfg.target_layer_ids == tuple(ids)


@pytest.mark.parametrize("over, message", [
    (dict(num_hidden_layers=3, layer_types=["full_attention"] * 2),
     "layer_types has 2 entries but num_hidden_layers=3"),
    (dict(layer_types=["sliding_attention", "full_attention"]), "layer 0 is sliding_attention but sliding_window"),
    (dict(layer_types=["full_attention", "linear_attention"]), r"layer_types\[1\] = 'linear_attention' is not a"),
    (dict(num_key_value_heads=3), "not a multiple of num_key_value_heads=3"),
    (dict(dflash_config=dict(mask_token_id=95, target_layer_ids=[0, 4])), r"must lie in 0..num_target_layers-1"),
    (dict(dflash_config=dict(target_layer_ids=[0, 2])), "missing required field 'mask_token_id'"),
    (dict(rope_scaling=dict(rope_type="dynamic", factor=4.0)), "rope_type 'dynamic' is not supported"),
    (dict(layer_types=["sliding_attention", "full_attention"], sliding_window=2, is_causal=False),
     "non-causal sliding_window=2 must be >= block_size=4"),
])
def test_config_errors(over, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(**over)


# ---- loading against a target ----

TARGET = TargetConfig(vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2,
                      linear_key_head_dim=8, linear_value_head_dim=8, intermediate_size=48,
                      layer_types=("linear_attention", "full_attention") * 2)


@pytest.fixture(scope="module")
def target():
    """A shape-only Target (the loader reads its config and dtype, never its weights): no random init."""
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Qwen35ForCausalLM(TARGET, rngs=nnx.Rngs(0))))
    return Target(TARGET, graphdef, params)


def test_real_config_parses_and_fits_its_target():
    """Qwen3.6-27B-DFlash's config.json fields (as z-lab publishes them) against the 27B target's sizes."""
    raw = {**BASE, "hidden_size": 5120, "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 4,
           "head_dim": 128, "intermediate_size": 17408, "vocab_size": 248320, "block_size": 16,
           "num_target_layers": 64, "rope_theta": 10000000, "rope_scaling": None, "sliding_window": None,
           "layer_types": ["full_attention"] * 5, "use_sliding_window": False, "max_window_layers": 5,
           "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]}}
    cfg = DrafterConfig.from_hf(raw)
    assert (cfg.rope_theta, cfg.target_hidden_size, cfg.is_causal) == (1e7, 5120, None)
    assert DrafterConfig.from_hf(cfg.to_hf()) == cfg
    check_fits(cfg, TargetConfig(vocab_size=248320, hidden_size=5120, num_hidden_layers=64, num_attention_heads=24,
                                 num_key_value_heads=4, head_dim=256, intermediate_size=17408,
                                 layer_types=(("linear_attention",) * 3 + ("full_attention",)) * 16))


def test_save_load_round_trip_is_bit_exact(tmp_path, target):
    cfg = _cfg(layer_types=["sliding_attention", "full_attention"], sliding_window=3, is_causal=False,
               block_size=3)
    d = _drafter(cfg)
    save_drafter(tmp_path, d)
    loaded = load_drafter(tmp_path, target, progress=False)
    assert loaded.cfg == cfg
    want, got = nnx.to_flat_state(d.params), nnx.to_flat_state(loaded.params)
    assert [p for p, _ in want] == [p for p, _ in got]
    for (p, a), (_, b) in zip(want, got, strict=True):
        assert b.get_value().dtype == target.dtype, p
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(p))


def test_load_ignores_shipped_embedding_and_reports_missing_tensor(tmp_path, target):
    d = _drafter(_cfg())
    save_drafter(tmp_path, d)
    file = tmp_path / "model.safetensors"
    tensors = {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(d.params)}
    extra = {"embed_tokens.weight": np.zeros((96, 32), np.float32), "lm_head.weight": np.zeros((96, 32), np.float32)}
    checkpoint.write_safetensors(file, {**tensors, **extra})
    load_drafter(tmp_path, target, progress=False)
    del tensors["layers.1.mlp.down_proj.weight"]
    checkpoint.write_safetensors(file, tensors)
    with pytest.raises(CheckpointError, match=r"missing tensor 'layers.1.mlp.down_proj.weight' with shape \(32, 48\)"):
        load_drafter(tmp_path, target, progress=False)


@pytest.mark.parametrize("over, message", [
    (dict(target_hidden_size=48), r"fc takes 2 x target_hidden_size 48 = 96 inputs, but 2 taps of the target "
                                  r"\(hidden_size 32\) give 64"),
    (dict(hidden_size=48, target_hidden_size=32), "drafter hidden_size 48 != target hidden_size 32"),
    (dict(dflash_config=dict(mask_token_id=96, target_layer_ids=[0, 2])),
     "mask_token_id 96 is not a row of the target's embedding"),
    (dict(num_target_layers=8, dflash_config=dict(mask_token_id=95, target_layer_ids=[0, 5])),
     r"target_layer_ids \[0, 5\] include \[5\], outside the target's layers 0..3"),
    (dict(vocab_size=128), "drafter vocab_size 128 != target vocab_size 96"),
])
def test_fit_errors(over, message):
    with pytest.raises(ConfigError, match=message):
        check_fits(_cfg(**over), TARGET)


def test_load_checks_fit_before_reading_weights(tmp_path, target):
    save_drafter(tmp_path, init_drafter(_cfg(vocab_size=128)))
    with pytest.raises(ConfigError, match="drafter vocab_size 128 != target vocab_size 96"):
        load_drafter(tmp_path, target, progress=False)


def test_draft_window_flag_reaches_the_drafter():
    """``--draft-window`` as generate / bench / serve pass it (``frontend.load_models``) on the shipped pair: the
    drafter's layers see at most N context positions; below its block size a one-line error names the flag."""
    from dflash_jax import frontend

    dirs, method = (frontend.ASSETS / "target", frontend.ASSETS / "drafter"), [frontend.Method("dflash", 16)]
    _, drafter = frontend.load_models(*dirs, method, dtype=jnp.float32, progress=False, draft_window=64)
    assert drafter.cfg.draft_window == 64 and drafter.module().layers[0].context == 64
    with pytest.raises(ValueError, match="--draft-window 8: must be >= the drafter's block size 16"):
        frontend.load_models(*dirs, method, dtype=jnp.float32, progress=False, draft_window=8)


@pytest.mark.slow
def test_greedy_decoding_with_a_draft_window_equals_plain_decoding():
    """The shipped pair, a 300-token prompt, --draft-window 16 (the block: the drafter sees almost no context):
    drafts change, the tokens do not."""
    from dflash_jax import frontend
    from dflash_jax.decoding.api import generate

    dirs = (frontend.ASSETS / "target", frontend.ASSETS / "drafter")
    target, full = frontend.load_models(*dirs, [frontend.Method("dflash", 16)], dtype=jnp.float32, progress=False)
    bounded = load_drafter(dirs[1], target, window=16, progress=False)
    prompt = [list(np.random.default_rng(0).integers(2, 512, 300))]
    plain = generate(target, prompt, max_new_tokens=48, stop_ids=())
    for d in (full, bounded):
        out = generate(target, prompt, drafter=d, max_new_tokens=48, stop_ids=())
        np.testing.assert_array_equal(out.tokens, plain.tokens)
