"""Function-preserving growth of a trained target into a wider and deeper one (a warm start for pretraining).

Sits beside ``lm.py``: it works on Hugging Face checkpoint tensors (``layers.hf_tensors``: the GDN channels
in the checkpoint's q | k | v order) and writes a checkpoint directory that ``load_target`` reads. The
grown model computes the same logits as the old one (``check``), so training continues from the old
model's loss instead of a random model's. How each kind of weight grows:

- hidden width D -> D': the new residual dims start at zero and stay zero until trained: every weight that
  *writes* the residual (embedding, ``o_proj``, GDN ``out_proj``, ``down_proj``) gets zero new rows/columns,
  every weight that *reads* it gets fresh random new columns (they multiply zeros, and break the symmetry).
  The zero-centred RMSNorms over D see the old values with their mean square scaled by D/D', so their
  weights become s(1 + w) - 1 with s = sqrt(D/D') (s - 1 on the new dims): normalised values unchanged.
- MLP width F -> F': new gate/up rows random, new ``down_proj`` columns zero.
- heads (attention N/K, GDN Hk/Hv; head dims unchanged, so the per-head q/k norms and the GDN's plain-w
  output norm are unchanged): new heads appended after the old ones, with the GQA group size N/K and the
  value-per-key ratio Hv/Hk kept, so every old head still reads the same KV/key head (n // (N/K),
  j // (Hv/Hk)); their output projection columns are zero.
- depth: the old layers keep their order at the positions ``layer_map`` gives; the new layers are fresh
  with zero output projections (attention/GDN and MLP), so they add nothing to the residual stream.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from dflash_jax.config import TargetConfig
from dflash_jax.io import atomic, checkpoint
from dflash_jax.models.layers import hf_tensors
from dflash_jax.models.target import Target, forward, init_target, load_target
from dflash_jax.train import lm

# Per-layer tensors that write the residual stream: zero outside the old block.
_WRITES = ("self_attn.o_proj.weight", "linear_attn.out_proj.weight", "mlp.down_proj.weight")
_D_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")


def grown_config(old: TargetConfig, *, hidden: int, layers: int, intermediate: int, heads: int, kv_heads: int,
                 linear_key_heads: int, linear_value_heads: int) -> TargetConfig:
    """``old`` with new sizes (every 4th layer gated attention, as ``lm.small_config``); all else kept."""
    return dataclasses.replace(
        old, hidden_size=hidden, num_hidden_layers=layers, intermediate_size=intermediate,
        layer_types=tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)),
        num_attention_heads=heads, num_key_value_heads=kv_heads, linear_num_key_heads=linear_key_heads,
        linear_num_value_heads=linear_value_heads)


def default_layer_map(old: TargetConfig, new: TargetConfig) -> list[int]:
    """New position of each old layer: a layer keeps its kind, the old last layer stays last (it feeds the
    final norm), and the others keep their positions; the new layers fill the middle."""
    old_types, new_types = old.layer_types, new.layer_types
    out = list(range(old.num_hidden_layers - 1)) + [new.num_hidden_layers - 1]
    bad = [(i, j) for i, j in enumerate(out) if old_types[i] != new_types[j]]
    if bad or len(set(out)) != len(out):
        raise ValueError(f"old layers {old_types} do not fit the new pattern {new_types} at positions {out}")
    return out


def _gdn_channel_index(old: TargetConfig, new: TargetConfig) -> np.ndarray:
    """New index of each old GDN channel in the HF order q heads | k heads | v heads (heads appended)."""
    qk_old = old.linear_num_key_heads * old.linear_key_head_dim
    qk_new = new.linear_num_key_heads * new.linear_key_head_dim
    v_old = old.linear_num_value_heads * old.linear_value_head_dim
    return np.concatenate([np.arange(qk_old), qk_new + np.arange(qk_old), 2 * qk_new + np.arange(v_old)])


def _check_compatible(old: TargetConfig, new: TargetConfig) -> None:
    same = ("vocab_size", "head_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
            "tie_word_embeddings", "rope_theta", "partial_rotary_factor", )
    diff = [k for k in same if getattr(old, k) != getattr(new, k)]
    if diff:
        raise ValueError(f"growth keeps {diff} unchanged: old {[getattr(old, k) for k in diff]}, "
                         f"new {[getattr(new, k) for k in diff]}")
    for name, a, b in (("hidden_size", old.hidden_size, new.hidden_size),
                       ("intermediate_size", old.intermediate_size, new.intermediate_size),
                       ("num_hidden_layers", old.num_hidden_layers, new.num_hidden_layers),
                       ("num_attention_heads", old.num_attention_heads, new.num_attention_heads),
                       ("linear_num_key_heads", old.linear_num_key_heads, new.linear_num_key_heads)):
        if b < a:
            raise ValueError(f"growth cannot shrink {name}: {a} -> {b}")
    if (old.num_attention_heads * new.num_key_value_heads != new.num_attention_heads * old.num_key_value_heads
            or old.linear_num_value_heads * new.linear_num_key_heads
            != new.linear_num_value_heads * old.linear_num_key_heads):
        raise ValueError("growth keeps the GQA group size N/K and the GDN ratio Hv/Hk (old heads must keep their "
                         "KV / key heads)")


def grow_tensors(old: Target, new_cfg: TargetConfig, *, seed: int = 0,
                 layer_map: list[int] | None = None) -> dict[str, np.ndarray]:
    """The grown model's HF tensors (no MTP head: a new one is trained on the grown target)."""
    oc, nc = old.cfg, new_cfg
    _check_compatible(oc, nc)
    layer_map = default_layer_map(oc, nc) if layer_map is None else layer_map
    old_t = {k: v for k, v in hf_tensors(oc, old.params) if not k.startswith("mtp.")}
    fresh = dict(hf_tensors(nc, init_target(nc, dtype=jnp.float32, mtp=False, seed=seed).params))
    D, Dn = oc.hidden_size, nc.hidden_size
    s = np.sqrt(D / Dn)
    H, Hd = oc.head_dim, oc.linear_value_head_dim
    # Old index -> new index of each kind of axis (prefixes: new heads / units / dims are appended).
    axes = {
        "D": np.arange(D), "F": np.arange(oc.intermediate_size),
        "q": np.arange(oc.num_attention_heads * 2 * H), "kv": np.arange(oc.num_key_value_heads * H),
        "o": np.arange(oc.num_attention_heads * H), "C": _gdn_channel_index(oc, nc),
        "Vd": np.arange(oc.linear_num_value_heads * Hd), "Hv": np.arange(oc.linear_num_value_heads),
    }
    shapes = {  # suffix -> axis kinds of the HF tensor
        "self_attn.q_proj.weight": ("q", "D"), "self_attn.k_proj.weight": ("kv", "D"),
        "self_attn.v_proj.weight": ("kv", "D"), "self_attn.o_proj.weight": ("D", "o"),
        "self_attn.q_norm.weight": (None,), "self_attn.k_norm.weight": (None,),
        "linear_attn.in_proj_qkv.weight": ("C", "D"), "linear_attn.in_proj_z.weight": ("Vd", "D"),
        "linear_attn.in_proj_b.weight": ("Hv", "D"), "linear_attn.in_proj_a.weight": ("Hv", "D"),
        "linear_attn.conv1d.weight": ("C", None, None), "linear_attn.A_log": ("Hv",),
        "linear_attn.dt_bias": ("Hv",), "linear_attn.norm.weight": (None,),
        "linear_attn.out_proj.weight": ("D", "Vd"),
        "mlp.gate_proj.weight": ("F", "D"), "mlp.up_proj.weight": ("F", "D"), "mlp.down_proj.weight": ("D", "F"),
    }

    def place(new: np.ndarray, old_arr: np.ndarray, kinds, *, zero: bool) -> np.ndarray:
        out = np.zeros_like(new) if zero else new.copy()
        index = [np.arange(n) if k is None else axes[k] for k, n in zip(kinds, old_arr.shape, strict=True)]
        out[np.ix_(*index)] = old_arr
        return out

    def norm(old_w: np.ndarray) -> np.ndarray:  # zero-centred RMSNorm over D: the same normalised values
        return np.concatenate([s * (1 + old_w) - 1, np.full(Dn - D, s - 1, old_w.dtype)]).astype(old_w.dtype)

    out = dict(fresh)
    out["model.embed_tokens.weight"] = place(fresh["model.embed_tokens.weight"], old_t["model.embed_tokens.weight"],
                                             (None, "D"), zero=True)
    out["model.norm.weight"] = norm(old_t["model.norm.weight"])
    new_layers = set(range(nc.num_hidden_layers)) - set(layer_map)
    for j in new_layers:
        for suffix in _WRITES:
            key = f"model.layers.{j}.{suffix}"
            if key in out:
                out[key] = np.zeros_like(out[key])
    for i, j in enumerate(layer_map):
        prefix_old, prefix_new = f"model.layers.{i}.", f"model.layers.{j}."
        for key, arr in old_t.items():
            if not key.startswith(prefix_old):
                continue
            suffix = key[len(prefix_old):]
            if suffix in _D_NORMS:
                out[prefix_new + suffix] = norm(arr)
            elif suffix in shapes:
                out[prefix_new + suffix] = place(fresh[prefix_new + suffix], arr, shapes[suffix],
                                                 zero=suffix in _WRITES)
            else:
                raise KeyError(f"grow: no growth rule for {key} {arr.shape}")
    missing = set(old_t) - {"model.embed_tokens.weight", "model.norm.weight"} - {
        k for k in old_t if k.startswith("model.layers.")}
    if missing:
        raise KeyError(f"grow: no growth rule for {sorted(missing)}")
    return out


def grow(old: Target, new_cfg: TargetConfig, path: str | Path, *, seed: int = 0) -> Target:
    """Writes the grown checkpoint to ``path`` (config.json + model.safetensors, f32) and loads it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    atomic.write_text(path / "config.json", json.dumps(lm.hf_config(new_cfg), indent=2))
    checkpoint.write_safetensors(path / "model.safetensors", grow_tensors(old, new_cfg, seed=seed),
                                 metadata={"format": "pt"})
    return load_target(path, jnp.float32, mtp=False, progress=False)


def _with_eps(target: Target, eps: float) -> Target:
    from flax import nnx

    from dflash_jax.models.target import Qwen35ForCausalLM
    cfg = dataclasses.replace(target.cfg, rms_norm_eps=eps)
    model = nnx.eval_shape(lambda: Qwen35ForCausalLM(cfg, dtype=jnp.float32, kernels=target.kernels, rngs=nnx.Rngs(0)))
    return Target(cfg, nnx.graphdef(model), target.params)


def check(old: Target, grown: Target, tokens: np.ndarray, *, eps: float | None = None) -> float:
    """Max |logits difference| of the two models over token windows [B, T] (full-sequence forward).

    The RMSNorms' epsilon is the one thing growth does not preserve: over D' dims the old values' mean
    square is D/D' as large, so the same eps weighs D'/D as much (a ~1e-3 relative change where a norm's
    input is as small as the trained embeddings). ``eps`` (e.g. 1e-30) runs both models with that eps
    instead, which isolates the growth's arithmetic: it should then agree to float32 rounding."""
    if eps is not None:
        old, grown = _with_eps(old, eps), _with_eps(grown, eps)
    a = forward(old.graphdef, old.params, jnp.asarray(tokens)).logits
    b = forward(grown.graphdef, grown.params, jnp.asarray(tokens)).logits
    return float(jnp.max(jnp.abs(a - b)))
