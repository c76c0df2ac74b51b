"""The Qwen3.5 target against transformers, and verify/commit against processing only the kept tokens.

Every test reuses the same few shapes (batch 4 or 1, bucket 100, capacity 128) so each model
compiles prefill/verify only a handful of times.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_oracle import hf_hidden_states, hf_logits

from dflash_jax.config import ConfigError, TargetConfig
from dflash_jax.io import atomic, checkpoint
from dflash_jax.io.checkpoint import CheckpointError
from dflash_jax.models.cache import AttentionCache, GDNCache
from dflash_jax.models.layers import hf_tensors
from dflash_jax.models.target import CONVERTED, Target, load_target, save_converted

LENGTHS = (1, 17, 64, 100)  # 64 is the GDN chunk; 100 crosses it
BUCKET, CAPACITY, TAPS = 100, 128, (2, 0)
ATOL = 1e-4


@pytest.fixture(scope="module", params=["dense", "moe"])
def pair(request):
    hf, path = request.getfixturevalue(f"hf_{request.param}")
    return hf, load_target(path, dtype=jnp.float32, progress=False)


def _tokens(vocab, shape, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


def _close(ours, ref):
    ours = np.asarray(ours)
    assert np.abs(ours - ref).max() <= ATOL, np.abs(ours - ref).max()
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))


def _prefill(tg, rows):
    """Right-pads token rows into the shared [len(rows), BUCKET] bucket."""
    tokens = np.zeros((len(rows), BUCKET), np.int32)
    for b, r in enumerate(rows):
        tokens[b, :len(r)] = r
    return tg.prefill(tokens, [len(r) for r in rows], capacity=CAPACITY, taps=TAPS)


def test_prefill_mixed_batch_matches_transformers(pair):
    hf, tg = pair
    tokens = _tokens(tg.cfg.vocab_size, (len(LENGTHS), BUCKET))
    out, cache = _prefill(tg, [tokens[b, :n] for b, n in enumerate(LENGTHS)])
    np.testing.assert_array_equal(cache.lengths, LENGTHS)
    D = tg.cfg.hidden_size
    for b, n in enumerate(LENGTHS):
        _close(out.logits[b], hf_logits(hf, tokens[b:b + 1, :n])[0, -1])
        hs = hf_hidden_states(hf, tokens[b:b + 1, :n])
        # Taps are layer outputs (HF hidden_states[i + 1]) in the requested order.
        np.testing.assert_allclose(out.taps[b, :n, :D], hs[3][0], atol=ATOL)
        np.testing.assert_allclose(out.taps[b, :n, D:], hs[1][0], atol=ATOL)


def test_last_layer_tap_is_the_final_normed_state_as_in_transformers(hf_dense):
    """z-lab's convention: tap i is transformers' hidden_states[i + 1], which for the last layer is normed."""
    hf, path = hf_dense
    tg = load_target(path, dtype=jnp.float32, progress=False)
    L, D = tg.cfg.num_hidden_layers, tg.cfg.hidden_size
    tokens = _tokens(tg.cfg.vocab_size, (1, 20), seed=3)
    hs = hf_hidden_states(hf, tokens)
    assert len(hs) == L + 1
    taps = (L - 1, 1)
    out, _ = tg.prefill(tokens, [20], capacity=32, taps=taps)
    np.testing.assert_allclose(out.taps[0, :, :D], hs[L][0], atol=ATOL)
    np.testing.assert_allclose(out.taps[0, :, :D], out.hidden[0], atol=1e-6)  # the normed state itself
    np.testing.assert_allclose(out.taps[0, :, D:], hs[2][0], atol=ATOL)
    from dflash_jax.models.target import forward
    full = forward(tg.graphdef, tg.params, jnp.asarray(tokens), taps=taps)
    np.testing.assert_allclose(full.taps[0, :, :D], hs[L][0], atol=ATOL)
    _, cache = tg.prefill(tokens[:, :19], [19], capacity=32)
    step, _ = tg.verify(tokens[:, 19:], cache, taps=taps)
    np.testing.assert_allclose(step.taps[0, 0, :D], hs[L][0, 19], atol=ATOL)


def test_prefill_one_row_at_a_time_matches_transformers(pair):
    hf, tg = pair
    for n in LENGTHS:
        tokens = _tokens(tg.cfg.vocab_size, (1, n), seed=n)
        out, _ = _prefill(tg, [tokens[0]])
        _close(out.logits[0], hf_logits(hf, tokens)[0, -1])


def test_decode_token_by_token_matches_full_forward(pair):
    hf, tg = pair
    prompt_lens, total = np.array([3, 9, 1, 20]), 40
    tokens = _tokens(tg.cfg.vocab_size, (4, total), seed=1)
    ref = hf_logits(hf, tokens)
    _, cache = _prefill(tg, [tokens[b, :n] for b, n in enumerate(prompt_lens)])
    pos = prompt_lens.copy()
    while pos.max() < total:
        step = tokens[np.arange(4), np.minimum(pos, total - 1)][:, None]
        out, cache = tg.verify(step, cache, taps=TAPS)
        cache = Target.commit(cache, [1] * 4)
        for b in np.flatnonzero(pos < total):
            _close(out.logits[b, 0], ref[b, pos[b]])
        pos += 1


def _assert_same_cache(a, b, exact=True):
    np.testing.assert_array_equal(a.lengths, b.lengths)
    check = np.testing.assert_array_equal if exact else (
        lambda x, y: np.testing.assert_allclose(x, y, atol=2e-6, rtol=1e-5))
    for ca, cb in zip(a.layers, b.layers, strict=True):
        if isinstance(ca, AttentionCache):
            for row, n in enumerate(np.asarray(a.lengths)):  # rows past the length are dead
                check(ca.k[row, :, :n], cb.k[row, :, :n])  # [K, S, H]
                check(ca.v[row, ..., :n], cb.v[row, ..., :n])  # [K, H, S]
        else:
            assert isinstance(ca, GDNCache) and ca.pending is None and cb.pending is None
            check(ca.conv, cb.conv)
            check(ca.state, cb.state)


def _truncate_pending(cache, n):
    layers = tuple(
        dataclasses.replace(c, pending=jax.tree.map(lambda x: x[:, :n], c.pending))
        if isinstance(c, GDNCache) else c for c in cache.layers)
    return dataclasses.replace(cache, layers=layers)


def _row(cache, b):
    return jax.tree.map(lambda x: x[b:b + 1], cache)


def _copy(cache):
    """verify and commit donate their cache: tests that reuse one hand over a copy."""
    return jax.tree.map(jnp.copy, cache)


@pytest.mark.slow
def test_verify16_then_commit_n_equals_processing_n_tokens(pair):
    _, tg = pair
    prompt_lens = (7, 20, 1, 64)
    tokens = _tokens(tg.cfg.vocab_size, (4, 64 + 16), seed=2)
    _, base = _prefill(tg, [tokens[b, :p] for b, p in enumerate(prompt_lens)])
    block = np.stack([tokens[b, p:p + 16] for b, p in enumerate(prompt_lens)])
    _, verified = tg.verify(block, _copy(base), taps=TAPS)
    # The first n tokens processed alone, one at a time.
    alone = [base]
    for t in range(16):
        alone.append(Target.commit(tg.verify(block[:, t:t + 1], _copy(alone[-1]), taps=TAPS)[1], [1] * 4))
    for n in range(17):
        kept = Target.commit(_copy(verified), [n] * 4)
        # Equal up to matmul rounding (XLA may round a [B, 16] projection unlike a [B, 1] one).
        _assert_same_cache(kept, alone[n], exact=False)
        if n in (3, 16):
            # Replaying only the first n recorded inputs gives the identical cache: the masked
            # tail steps (g = beta = 0) are exact no-ops.
            _assert_same_cache(kept, Target.commit(_truncate_pending(_copy(verified), n), [n] * 4))
        if n in (0, 5, 16):  # and what a prefill of prompt + kept tokens builds (chunked GDN form)
            _, pre = _prefill(tg, [np.concatenate([tokens[b, :p], block[b, :n]])
                                   for b, p in enumerate(prompt_lens)])
            _assert_same_cache(kept, pre, exact=False)
    # Rows commit independently.
    kept = Target.commit(_copy(verified), [3, 11, 0, 16])
    for b, n in enumerate((3, 11, 0, 16)):
        _assert_same_cache(_row(kept, b), _row(alone[n], b), exact=False)


def test_conditional_generation_layout_loads_and_matches(hf_moe_conditional):
    hf, path = hf_moe_conditional
    tg = load_target(path, dtype=jnp.float32, progress=False)
    assert tg.cfg.is_moe and tg.cfg.num_experts_per_tok == 2
    tokens = _tokens(tg.cfg.vocab_size, (1, 30), seed=3)
    out, _ = _prefill(tg, [tokens[0]])
    _close(out.logits[0], hf_logits(hf, tokens)[0, -1])


def test_bf16_agrees_with_f32(hf_dense):
    _, path = hf_dense
    tokens = _tokens(96, (1, 40), seed=4)
    f32 = _prefill(load_target(path, dtype=jnp.float32, progress=False), [tokens[0]])[0]
    b16 = _prefill(load_target(path, dtype=jnp.bfloat16, progress=False), [tokens[0]])[0]
    p, q = jax.nn.log_softmax(f32.logits), jax.nn.log_softmax(b16.logits.astype(jnp.float32))
    assert float(jnp.sum(jnp.exp(p) * (p - q))) < 1e-2


def test_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="not a Qwen3.5 text model"):
        TargetConfig.from_hf({"architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ConfigError, match="missing required field 'vocab_size'"):
        TargetConfig.from_hf({"architectures": ["Qwen3_5ForCausalLM"], "num_hidden_layers": 1})
    with pytest.raises(ConfigError, match="no config.json"):
        TargetConfig.from_pretrained(tmp_path)


def test_converted_copy_restores_bit_exactly(hf_moe, tmp_path):
    _, path = hf_moe
    tg = load_target(path, dtype=jnp.bfloat16, progress=False)
    save_converted(tg, path, tmp_path / "converted")
    again = load_target(tmp_path / "converted")
    assert again.cfg == tg.cfg and again.dtype == jnp.bfloat16
    for a, b in zip(jax.tree.leaves(tg.params), jax.tree.leaves(again.params), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    # A copy that records no GDN channel order (one converted before the channels were head-grouped, whose
    # manifest lists its files as they are) is refused, not misread.
    meta_file = tmp_path / "converted" / CONVERTED / checkpoint.META
    meta = json.loads(meta_file.read_text())
    del meta["gdn_channels"]
    meta_file.write_text(json.dumps(meta))
    atomic.write_manifest(tmp_path / "converted")
    with pytest.raises(CheckpointError, match=r"records no gdn_channels, .* q \| k \| v order: convert it again"):
        load_target(tmp_path / "converted")


def test_saved_tensors_are_the_checkpoint_s(hf_dense, tmp_path):
    """A target saved as safetensors (``train.lm.save_target``, through ``hf_tensors``) holds transformers'
    own tensors, the GDN q | k | v rows included, though the loaded model holds those rows head-grouped;
    loaded back it is the same model."""
    from safetensors.numpy import load_file

    from dflash_jax.train.lm import save_target

    hf, path = hf_dense
    tg = load_target(path, dtype=jnp.float32, progress=False)
    save_target(tmp_path / "saved", tg)
    theirs = {k: v.numpy() for k, v in hf.state_dict().items()}
    written = load_file(tmp_path / "saved" / "model.safetensors")
    assert written.keys() == {key for key, _ in hf_tensors(tg.cfg, tg.params)}
    for key, a in written.items():
        np.testing.assert_array_equal(a, theirs[key], err_msg=key)
    qkv = "model.layers.0.linear_attn.in_proj_qkv.weight"
    loaded = np.asarray(tg.params["model"]["layers"][0]["linear_attn"]["in_proj_qkv"]["weight"].get_value())
    assert written[qkv].shape == loaded.shape and not np.array_equal(written[qkv], loaded)
    again = load_target(tmp_path / "saved", dtype=jnp.float32, progress=False)
    for a, b in zip(jax.tree.leaves(tg.params), jax.tree.leaves(again.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_verify_and_commit_donate_the_cache(pair):
    """A step updates the cache in place: the caches handed to verify and commit are consumed."""
    _, tg = pair
    _, cache = _prefill(tg, [[1, 2, 3]] * 4)
    _, verified = tg.verify(np.ones((4, 16), np.int32), cache, taps=TAPS)
    assert all(x.is_deleted() for x in jax.tree.leaves(cache))
    kept = Target.commit(verified, [2] * 4)
    reused = [x for c in verified.layers
              for x in jax.tree.leaves(dataclasses.replace(c, pending=None) if isinstance(c, GDNCache) else c)]
    assert all(x.is_deleted() for x in reused)  # the pending inputs are only read
    np.testing.assert_array_equal(kept.lengths, [5] * 4)
