"""RoPE types against transformers: frequencies vs ROPE_INIT_FUNCTIONS, target logits vs its Qwen3.5 model
with YaRN and linear scaling, and the drafter's rotation vs Qwen3RotaryEmbedding (z-lab's drafter uses it)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.config import ConfigError, DrafterConfig, RopeScaling, TargetConfig
from dflash_jax.models.drafter import init_drafter
from dflash_jax.models.rope import frequencies, rotate, rotation, rows, table
from dflash_jax.models.target import forward, init_target, load_target

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

TINY = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
            num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=8, intermediate_size=48, max_position_embeddings=4096)
ROPES = {
    "linear": dict(rope_type="linear", factor=4.0),
    "yarn": dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=512),
    "yarn_mscale": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=256, mscale=0.707,
                        mscale_all_dim=1.0, beta_fast=16, beta_slow=2, truncate=False),
    "yarn_attention_factor": dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=1024,
                                  attention_factor=1.25),
    "yarn_factor_from_lengths": dict(rope_type="yarn", factor=None, original_max_position_embeddings=1024),
    "llama3": dict(rope_type="llama3", factor=8.0, original_max_position_embeddings=512, low_freq_factor=1.0,
                   high_freq_factor=4.0),
}

_forward = jax.jit(forward, static_argnums=0)


def _hf_config(rope_params, partial=0.5, theta=1e6):
    return transformers.Qwen3_5TextConfig(**TINY, rope_parameters={**rope_params, "rope_theta": theta,
                                                                   "partial_rotary_factor": partial})


@pytest.mark.parametrize("name", sorted(ROPES))
@pytest.mark.parametrize("partial", [0.25, 1.0])
def test_frequencies_match_transformers(name, partial):
    hf = _hf_config(dict(ROPES[name]), partial)
    want, want_scale = ROPE_INIT_FUNCTIONS[hf.rope_parameters["rope_type"]](hf)
    cfg = TargetConfig.from_hf(hf.to_dict())
    assert cfg.rope_scaling.rope_type == hf.rope_parameters["rope_type"]
    got, scale = frequencies(cfg.rope_theta, cfg.rotary_dim, cfg.rope_scaling)
    np.testing.assert_allclose(got, want.numpy(), rtol=2e-7, atol=0)
    assert scale == pytest.approx(want_scale, rel=1e-12)
    # The scaled schedule really differs from the default one (so these cases test something).
    plain, _ = frequencies(cfg.rope_theta, cfg.rotary_dim)
    assert not np.allclose(got, plain)


@pytest.mark.slow
def test_scaled_target_matches_transformers_logits(tmp_path):
    """A tiny Qwen3.5 with YaRN: our logits at every position vs transformers'."""
    tokens = np.random.default_rng(0).integers(0, 96, (1, 40)).astype(np.int32)
    for name in ("yarn_mscale",):
        torch.manual_seed(0)
        hf = transformers.Qwen3_5ForCausalLM(_hf_config(dict(ROPES[name]), partial=0.5, theta=100.0)).eval()
        hf.save_pretrained(tmp_path / name)
        tg = load_target(tmp_path / name, dtype=jnp.float32, progress=False)
        assert tg.cfg.rope_scaling.rope_type == ROPES[name]["rope_type"]
        with torch.no_grad():
            want = hf(torch.tensor(tokens)).logits.numpy()
        got = np.asarray(_forward(tg.graphdef, tg.params, jnp.asarray(tokens)).logits)
        assert np.abs(got - want).max() < 1e-4, (name, np.abs(got - want).max())
        # Without the scaling the logits move: the test sees the rope type.
        plain = dataclasses.replace(tg.cfg, rope_scaling=RopeScaling())
        graphdef = init_target(plain).graphdef
        other = np.asarray(_forward(graphdef, tg.params, jnp.asarray(tokens)).logits)
        assert np.abs(other - want).max() > 1e-3


def test_drafter_rotation_matches_qwen3_rotary_embedding():
    """z-lab's drafter rotates q/k with transformers' Qwen3RotaryEmbedding of its own (Qwen3) config."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

    raw = dict(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=32, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=48, vocab_size=96,
               max_position_embeddings=262144, num_target_layers=4,
               rope_parameters=dict(rope_type="yarn", rope_theta=1e7, factor=4.0,
                                    original_max_position_embeddings=65536),
               dflash_config=dict(block_size=4, mask_token_id=95, target_layer_ids=[1]))
    cfg = DrafterConfig.from_hf(raw)
    assert DrafterConfig.from_hf(cfg.to_hf()) == cfg
    emb = Qwen3RotaryEmbedding(transformers.Qwen3Config(**{k: v for k, v in raw.items() if k != "dflash_config"}))
    pos = np.array([[0, 5, 1000, 70000, 200000]])
    x = np.random.default_rng(0).standard_normal((1, 5, 2, 16)).astype(np.float32)
    cos, sin = emb(torch.tensor(x), torch.tensor(pos))
    want, _ = apply_rotary_pos_emb(torch.tensor(x).transpose(1, 2), torch.tensor(x).transpose(1, 2), cos, sin)
    rot = rotation(jnp.asarray(pos), theta=cfg.rope_theta, rotary_dim=cfg.head_dim, scaling=cfg.rope_scaling)
    got = rotate(jnp.asarray(x), rot)
    np.testing.assert_allclose(np.asarray(got), want.transpose(1, 2).numpy(), atol=2e-5)
    # A cache's table holds the same rows: rows(table, start, T) at positions start[b] + t.
    tab = table(70010, theta=cfg.rope_theta, rotary_dim=cfg.head_dim, scaling=cfg.rope_scaling)
    start = jnp.asarray([3, 69995])
    want_rows = rotation(start[:, None] + jnp.arange(5), theta=cfg.rope_theta, rotary_dim=cfg.head_dim,
                         scaling=cfg.rope_scaling)
    np.testing.assert_array_equal(np.asarray(rows(tab, start, 5)), np.asarray(want_rows))
    # ... and the drafter's attention uses it: k of a drafter layer vs the same rotation by hand.
    attn = init_drafter(cfg).module().layers[0].self_attn
    h = jnp.asarray(np.random.default_rng(1).standard_normal((1, 5, 32)).astype(np.float32))
    k, _ = attn.kv(h, rot)
    k_ref = rotate(attn.k_norm(attn.k_proj(h).reshape(1, 5, 1, 16)), rot)
    np.testing.assert_array_equal(np.asarray(k), np.asarray(k_ref))


@pytest.mark.parametrize("params, message", [
    (dict(rope_type="dynamic", factor=2.0), "rope_type 'dynamic' is not supported"),
    (dict(rope_type="longrope", short_factor=[1.0], long_factor=[1.0]), "rope_type 'longrope' is not supported"),
    (dict(rope_type="linear"), "missing required field 'rope_parameters.factor'|factor must be"),
    (dict(rope_type="linear", factor=-1.0), r"rope_parameters.factor must be a finite number > 0"),
    (dict(rope_type="yarn", factor=4.0, beta_fastest=3), r"fields \['beta_fastest'\] are not understood"),
    (dict(rope_type="llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0),
     "high_freq_factor must be > low_freq_factor"),
])
def test_rope_refusals(params, message):
    raw = {**TINY, "architectures": ["Qwen3_5ForCausalLM"], "rope_parameters": params}
    with pytest.raises(ConfigError, match=message):
        TargetConfig.from_hf(raw)
