"""The DFlash drafter: target hidden states injected into its KV cache, one pass drafts a whole block.

Sits after ``target.py`` (whose verify/prefill return the "taps": outputs of ``target_layer_ids``)
and is used by ``proposers.py``. The drafter is a small Qwen3 decoder with no embedding or LM head
of its own (it borrows the target's). ``write_context`` turns taps into K/V at the tokens' absolute
positions in every layer's cache (written for all T tokens, committed by ``advance``, like the
target's verify/commit); ``draft_block`` runs the block ``[anchor, mask x (Bk-1)]`` over
``[context ; block]`` in one pass, each layer a ``DrafterLayer`` call. Training
(``train/drafter.py``) runs this same ``draft_block``, batched over anchors, so there is one layer
forward. The module tree mirrors the z-lab checkpoint keys, so ``load_drafter`` is a plain
key-for-key load.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax import atomic, checkpoint, kernels
from dflash_jax.config import DEFAULT_THETA, ConfigError, Fields, TargetConfig, parsing, read_config_json, rope_scaling
from dflash_jax.kernels import dispatch
from dflash_jax.layers import MLP, Linear, RMSNorm, SplitModel
from dflash_jax.rope import RopeScaling, rotate, rows, table

DRAFTER_LAYER_TYPES = ("full_attention", "sliding_attention")


def default_target_layer_ids(num_target_layers: int, n: int) -> tuple[int, ...]:
    """z-lab's spread of n tapped layers over a target of L layers: from layer 1 to layer L - 3."""
    if n == 1:
        return (num_target_layers // 2,)
    return tuple(round(1 + i * (num_target_layers - 4) / (n - 1)) for i in range(n))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterConfig:
    """A z-lab DFlash drafter (``DFlashDraftModel``, Qwen3 layers): field names and layouts as its config.json."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = DEFAULT_THETA
    rope_scaling: RopeScaling = RopeScaling()
    layer_types: tuple[str, ...] = ()  # empty: all "full_attention"
    sliding_window: int | None = None
    is_causal: bool | None = None  # overrides every layer's causality when set
    target_hidden_size: int | None = None  # width of one tap; None: hidden_size
    # z-lab's optional transforms: block embeddings times input_embedding_scale; draft logits times
    # output_multiplier, then tanh-softcapped at final_logit_softcapping (None: off).
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    def __post_init__(self):
        # Normalise first (frozen, so via object.__setattr__): tuples keep the config hashable.
        fill = object.__setattr__
        fill(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        fill(self, "layer_types", tuple(self.layer_types) or ("full_attention",) * self.num_hidden_layers)
        if self.target_hidden_size is None:
            fill(self, "target_hidden_size", self.hidden_size)

        def need(ok: bool, msg: str):
            if not ok:
                raise ConfigError(msg)

        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "intermediate_size", "vocab_size", "block_size", "num_target_layers",
                     "target_hidden_size"):
            value = getattr(self, name)
            need(isinstance(value, int) and value > 0, f"{name} must be a positive integer, got {value!r}")
        for name in ("rms_norm_eps", "rope_theta", "input_embedding_scale", "output_multiplier"):
            value = getattr(self, name)
            need(isinstance(value, int | float) and np.isfinite(value) and value > 0,
                 f"{name} must be a finite number > 0, got {value!r}")
        cap = self.final_logit_softcapping
        need(cap is None or (np.isfinite(cap) and cap > 0), f"final_logit_softcapping={cap!r} must be > 0 or null")
        need(self.num_attention_heads % self.num_key_value_heads == 0,
             f"num_attention_heads={self.num_attention_heads} is not a multiple of "
             f"num_key_value_heads={self.num_key_value_heads}")
        need(self.head_dim % 2 == 0, f"head_dim={self.head_dim} must be even (RoPE rotates halves)")
        need(isinstance(self.mask_token_id, int) and self.mask_token_id >= 0,
             f"mask_token_id={self.mask_token_id!r} must be an integer >= 0")
        need(len(self.target_layer_ids) > 0, "target_layer_ids is empty")
        need(all(0 <= i < self.num_target_layers for i in self.target_layer_ids),
             f"target_layer_ids {list(self.target_layer_ids)} must lie in 0..num_target_layers-1 "
             f"(num_target_layers={self.num_target_layers})")
        need(len(self.layer_types) == self.num_hidden_layers,
             f"layer_types has {len(self.layer_types)} entries but num_hidden_layers={self.num_hidden_layers}")
        bad = sorted(set(self.layer_types) - set(DRAFTER_LAYER_TYPES))
        need(not bad, f"unknown layer_types {bad}; expected {DRAFTER_LAYER_TYPES}")
        for i, kind in enumerate(self.layer_types):
            if kind != "sliding_attention":
                continue
            need(isinstance(self.sliding_window, int) and self.sliding_window > 0,
                 f"layer {i} is sliding_attention but sliding_window={self.sliding_window!r}")
            # The attention kernel bounds the window only below (keys before the query); a non-causal
            # window narrower than the block would also have to hide keys after the query.
            need(self.layer_causal(i) or self.sliding_window >= self.block_size,
                 f"layer {i}: a non-causal sliding_window={self.sliding_window} must be >= "
                 f"block_size={self.block_size}")

    def layer_causal(self, i: int) -> bool:
        """Causal inside the block: z-lab's rule, sliding layers are causal unless is_causal says otherwise."""
        return self.is_causal if self.is_causal is not None else self.layer_types[i] == "sliding_attention"

    def layer_window(self, i: int) -> int | None:
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None

    @classmethod
    def from_hf(cls, raw: dict[str, Any], source: str = "config.json") -> DrafterConfig:
        """Parses a z-lab ``config.json`` (model_type qwen3). As z-lab's ``_draft_value``, the DFlash fields
        (block_size, mask_token_id, target_layer_ids, ...) are read from ``dflash_config`` first, then from
        the top level; block_size defaults to 16 there."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: must be a JSON object, not a {type(raw).__name__}")
        if "dflash_config" not in raw and "block_size" not in raw:
            raise ConfigError(f"{source}: not a DFlash drafter config (no dflash_config or block_size; "
                              f"architectures {raw.get('architectures')})")
        f = Fields(raw)
        with parsing(source):
            dflash = raw.get("dflash_config") or {}
            if not isinstance(dflash, dict):
                raise ConfigError(f"dflash_config must be an object, got {dflash!r}")
            d = Fields(dflash, "dflash_config.")
            f.read.add("dflash_config")
            if "DFlash2DraftModel" in (raw.get("architectures") or []) or any(
                    k in dflash for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")):
                raise ConfigError("DFlash2 drafters (dynamic convolutions, candidate selector) are not supported")

            def pick(key: str) -> Fields:  # z-lab's _draft_value: dflash_config first, then the top level
                return d if d.has(key) else f

            f.require("hidden_act", ("silu",), "silu", "the drafter MLP uses SiLU")
            f.require("attention_bias", (False,), False, "no z-lab drafter has projection biases")
            f.require("attention_dropout", (0, 0.0), 0.0, "no dropout")
            d.require("use_swa", (False,), False, "sliding windows come from layer_types and sliding_window")
            d.require("attention_sink_bias", (False,), False, "no attention sinks")
            n_layers = f.integer("num_hidden_layers")
            max_pos = f.integer("max_position_embeddings", 32768)
            rope, scaling = rope_scaling(f, max_position_embeddings=max_pos)
            if rope.number("partial_rotary_factor", 1.0) != 1.0:
                raise ConfigError(f"{rope.where}partial_rotary_factor != 1 is not supported "
                                  "(the drafter rotates the whole head)")
            # transformers' Qwen3Config: use_sliding_window=false drops the window; without layer_types, layers
            # from max_window_layers on slide. (use_sliding_window absent: explicit layer_types decide.)
            use_window = f.get("use_sliding_window", "layer_types" in raw)
            window = f.get("sliding_window") if use_window else None
            layer_types = f.get("layer_types") or [
                "sliding_attention" if window is not None and i >= f.integer("max_window_layers", 28, low=0)
                else "full_attention" for i in range(n_layers)]
            if "sliding_attention" in layer_types and not use_window:
                raise ConfigError("layer_types has sliding_attention layers but use_sliding_window is false "
                                  "(transformers then drops the window)")
            ids = pick("target_layer_ids").get("target_layer_ids")
            if ids is None:
                ids = default_target_layer_ids(f.integer("num_target_layers"), n_layers)
            elif not isinstance(ids, list) or not all(type(i) is int for i in ids):
                raise ConfigError(f"target_layer_ids must be a list of layer indices, got {ids!r}")
            # `is_causal: false` is meaningful (it makes sliding layers bidirectional): test for None.
            is_causal = f.get("is_causal")
            if is_causal is None:
                is_causal = d.get("causal")
            cap = pick("final_logit_softcapping").number("final_logit_softcapping", 0.0, positive=False)
            if cap < 0:
                raise ConfigError(f"final_logit_softcapping={cap} must be >= 0 (0 or null: off)")
            heads = f.integer("num_attention_heads")
            cfg = cls(
                hidden_size=f.integer("hidden_size"),
                num_hidden_layers=n_layers,
                num_attention_heads=heads,
                num_key_value_heads=f.integer("num_key_value_heads"),
                head_dim=f.integer("head_dim", f.integer("hidden_size") // heads),
                intermediate_size=f.integer("intermediate_size"),
                rms_norm_eps=f.number("rms_norm_eps", 1e-6),
                rope_theta=rope.number("rope_theta", f.number("rope_theta", DEFAULT_THETA)),
                rope_scaling=scaling,
                vocab_size=f.integer("vocab_size"),
                block_size=pick("block_size").integer("block_size", 16),
                mask_token_id=pick("mask_token_id").integer("mask_token_id", low=0),
                target_layer_ids=tuple(ids),
                num_target_layers=f.integer("num_target_layers"),
                layer_types=tuple(layer_types),
                sliding_window=window,
                is_causal=None if is_causal is None else bool(is_causal),
                target_hidden_size=f.integer("target_hidden_size", f.integer("hidden_size")),
                input_embedding_scale=pick("input_embedding_scale").number("input_embedding_scale", 1.0),
                output_multiplier=pick("output_multiplier").number("output_multiplier", 1.0),
                final_logit_softcapping=cap or None,
            )
        d.read |= {"block_size", "mask_token_id", "target_layer_ids", "input_embedding_scale", "output_multiplier",
                   "final_logit_softcapping", "mask_token"}
        f.read |= {"use_sliding_window", "sliding_window", "max_window_layers", "block_size", "mask_token_id",
                   "target_layer_ids", "input_embedding_scale", "output_multiplier", "final_logit_softcapping",
                   "tie_word_embeddings"}
        f.warn_unknown(source)
        d.warn_unknown(source)
        return cfg

    @classmethod
    def from_pretrained(cls, path: str | Path) -> DrafterConfig:
        return cls.from_hf(*read_config_json(path))

    def to_hf(self) -> dict[str, Any]:
        """The z-lab ``config.json`` dict; ``from_hf(to_hf())`` gives this config back."""
        rope_parameters = {**self.rope_scaling.to_hf(), "rope_theta": self.rope_theta}
        dflash = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)}
        for key, neutral in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0),
                             ("final_logit_softcapping", None)):
            if getattr(self, key) != neutral:
                dflash[key] = getattr(self, key)
        raw = {
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_act": "silu",
            "attention_bias": False, "tie_word_embeddings": False,
            "hidden_size": self.hidden_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "intermediate_size": self.intermediate_size,
            "rms_norm_eps": self.rms_norm_eps, "rope_parameters": rope_parameters,
            "vocab_size": self.vocab_size, "block_size": self.block_size,
            "num_target_layers": self.num_target_layers, "dflash_config": dflash,
            "layer_types": list(self.layer_types), "sliding_window": self.sliding_window,
            "use_sliding_window": "sliding_attention" in self.layer_types,
        }
        if self.is_causal is not None:
            raw["is_causal"] = self.is_causal
        if self.target_hidden_size != self.hidden_size:
            raw["target_hidden_size"] = self.target_hidden_size
        return raw


def draft_logits(cfg: DrafterConfig, logits: jax.Array) -> jax.Array:
    """z-lab's ``compute_logits`` on the target head's logits of drafter states: the output multiplier,
    then the tanh softcap (both no-ops at their defaults). [..., V] -> [..., V]."""
    if cfg.output_multiplier != 1.0:
        logits = logits * cfg.output_multiplier
    if cfg.final_logit_softcapping is not None:
        cap = cfg.final_logit_softcapping
        logits = jnp.tanh(logits / cap) * cap
    return logits


class DrafterAttention(nnx.Module):
    """Qwen3 attention (q/k norms, full-head NeoX RoPE, GQA) whose cache is fed by the target."""

    def __init__(self, cfg: DrafterConfig, *, dtype, kernels: str, rngs: nnx.Rngs):
        D, N, K, H = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.cfg = cfg
        self.kernels = kernels
        self.q_proj = Linear(D, N * H, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(D, K * H, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(D, K * H, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(N * H, D, dtype=dtype, rngs=rngs)
        self.q_norm = RMSNorm(H, cfg.rms_norm_eps, zero_centred=False, dtype=dtype)
        self.k_norm = RMSNorm(H, cfg.rms_norm_eps, zero_centred=False, dtype=dtype)

    def kv(self, h: jax.Array, rot: jax.Array) -> tuple[jax.Array, jax.Array]:
        """K/V of inputs h [B, T, D] whose positions' cos/sin are rot [B, T, 2, H/2]: each [B, T, K, H]."""
        cfg = self.cfg
        B, T, _ = h.shape
        k = rotate(self.k_norm(self.k_proj(h).reshape(B, T, cfg.num_key_value_heads, cfg.head_dim)), rot)
        return k, self.v_proj(h).reshape(B, T, cfg.num_key_value_heads, cfg.head_dim)

    def __call__(self, h: jax.Array, k_cache: jax.Array, v_cache: jax.Array, start: jax.Array, rot: jax.Array, *,
                 causal: bool, window: int | None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The block's attention over ``[context ; block]``.

        Args:
          h: [B, T, D] normed block inputs at positions start[b] + t.
          k_cache, v_cache: [B, K, S, H] / [B, K, H, S] (``kernels.cache_shapes``) holding the context K/V at
            positions [0, start[b]).
          start: [B] int32 committed context length (the block's first position).
          rot: [B, T, 2, H/2] the block positions' cos/sin (``rope.rows``).
        Returns:
          (output [B, T, D], the caches with the block's K/V written into rows [start, start + T)).
        """
        cfg = self.cfg
        B, T, _ = h.shape
        N, H = cfg.num_attention_heads, cfg.head_dim
        q = rotate(self.q_norm(self.q_proj(h).reshape(B, T, N, H)), rot)
        k, v = self.kv(h, rot)
        # The block sits right behind the committed context, so one kernel call covers [context ; block].
        k_cache, v_cache = kernels.write_cache(k_cache, v_cache, k, v, start)
        o = kernels.attention(q, k_cache, v_cache, start, start + T, causal=causal, window=window, impl=self.kernels)
        return self.o_proj(o.reshape(B, T, N * H)), k_cache, v_cache


class DrafterLayer(nnx.Module):
    """One Qwen3 decoder layer (pre-norm attention, then pre-norm SwiGLU), with its layer's mask settings."""

    def __init__(self, cfg: DrafterConfig, index: int, *, dtype, kernels: str, rngs: nnx.Rngs):
        D = cfg.hidden_size
        self.causal = cfg.layer_causal(index)  # static: causal inside the block
        self.window = cfg.layer_window(index)  # static: sliding window or None
        self.input_layernorm = RMSNorm(D, cfg.rms_norm_eps, zero_centred=False, dtype=dtype)
        self.self_attn = DrafterAttention(cfg, dtype=dtype, kernels=kernels, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(D, cfg.rms_norm_eps, zero_centred=False, dtype=dtype)
        self.mlp = MLP(D, cfg.intermediate_size, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, k_cache: jax.Array, v_cache: jax.Array, start: jax.Array,
                 rot: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, T, D] at positions start[b] + t (cos/sin rot) -> (x [B, T, D], caches with the block's K/V written)."""
        o, k_cache, v_cache = self.self_attn(self.input_layernorm(x), k_cache, v_cache, start, rot,
                                             causal=self.causal, window=self.window)
        x = x + o
        return x + self.mlp(self.post_attention_layernorm(x)), k_cache, v_cache


class DFlashDrafter(nnx.Module):
    """The z-lab ``DFlashDraftModel`` tree: fc, hidden_norm, layers.{i}, norm (no embedding, no head).

    ``kernels`` is the attention kernel mode (None: ``kernels.default_mode()``), a static attribute.
    """

    def __init__(self, cfg: DrafterConfig, *, dtype, kernels: str | None = None, rngs: nnx.Rngs):
        self.cfg = cfg
        self.kernels = kernels = dispatch.resolve(kernels)
        self.fc = Linear(len(cfg.target_layer_ids) * cfg.target_hidden_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centred=False, dtype=dtype)
        self.layers = nnx.List([DrafterLayer(cfg, i, dtype=dtype, kernels=kernels, rngs=rngs)
                                for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centred=False, dtype=dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftCache:
    k: tuple[jax.Array, ...]  # per drafter layer [B, K, S, H]
    v: tuple[jax.Array, ...]  # per drafter layer [B, K, H, S] (``kernels.cache_shapes``)
    lengths: jax.Array  # [B] int32 committed context tokens per row
    rope: jax.Array  # [S, 2, H/2] f32 cos/sin of every position (``rope.table``)


def init_draft_cache(cfg: DrafterConfig, batch: int, capacity: int, dtype) -> DraftCache:
    """An empty cache. Capacity must cover the longest context plus one block (its rows are written)."""
    k, v = zip(*(kernels.empty_cache(batch, capacity, cfg.num_key_value_heads, cfg.head_dim, dtype)
                 for _ in range(cfg.num_hidden_layers)), strict=True)
    return DraftCache(k=k, v=v, lengths=jnp.zeros((batch,), jnp.int32),
                      rope=table(capacity, theta=cfg.rope_theta, rotary_dim=cfg.head_dim, scaling=cfg.rope_scaling))


def write_context(drafter: DFlashDrafter, cache: DraftCache, taps: jax.Array) -> DraftCache:
    """KV injection: writes context K/V for T tokens at positions lengths[b] + t in every layer.

    Args:
      taps: [B, T, n * Dt] target layer outputs at ``target_layer_ids``, concatenated.
    Returns:
      The cache with rows [lengths, lengths + T) written; lengths unchanged (``advance`` commits).
    """
    T = taps.shape[1]
    c = drafter.hidden_norm(drafter.fc(taps.astype(drafter.fc.weight.dtype)))  # [B, T, D], shared by all layers
    rot = rows(cache.rope, cache.lengths, T)
    ks, vs = [], []
    for layer, kc, vc in zip(drafter.layers, cache.k, cache.v, strict=True):
        kc, vc = kernels.write_cache(kc, vc, *layer.self_attn.kv(c, rot), cache.lengths)
        ks.append(kc)
        vs.append(vc)
    return dataclasses.replace(cache, k=tuple(ks), v=tuple(vs))


def advance(cache: DraftCache, n) -> DraftCache:
    """Commits the first n[b] context tokens of the last ``write_context`` (n: [B] or scalar)."""
    return dataclasses.replace(cache, lengths=cache.lengths + jnp.asarray(n, jnp.int32))


def draft_block(drafter: DFlashDrafter, cache: DraftCache, x: jax.Array) -> tuple[jax.Array, DraftCache]:
    """One denoising pass over the block at positions lengths[b] + j.

    Args:
      x: [B, Bk, D] target embeddings of ``[anchor, mask x (Bk-1)]``.
    Returns:
      (final-normed hidden states [B, Bk, D] for the target's LM head, the cache with the block's
      K/V in rows [lengths, lengths + Bk): uncommitted, overwritten by the next ``write_context``).
    """
    cfg = drafter.cfg
    x = x.astype(drafter.fc.weight.dtype)
    if cfg.input_embedding_scale != 1.0:  # z-lab scales the block's embeddings
        x = x * cfg.input_embedding_scale
    start = cache.lengths
    rot = rows(cache.rope, start, x.shape[1])
    ks, vs = [], []
    for layer, kc, vc in zip(drafter.layers, cache.k, cache.v, strict=True):
        x, kc, vc = layer(x, kc, vc, start, rot)
        ks.append(kc)
        vs.append(vc)
    return drafter.norm(x), dataclasses.replace(cache, k=tuple(ks), v=tuple(vs))


@dataclasses.dataclass(frozen=True)
class Drafter(SplitModel):
    """A loaded drafter: config, the static graph and its parameters (a pytree); ``module()`` is the
    ``DFlashDrafter``, ``kernels`` / ``with_kernels`` its attention kernel mode."""

    cfg: DrafterConfig
    graphdef: nnx.GraphDef
    params: nnx.State


def init_drafter(cfg: DrafterConfig, *, dtype=jnp.float32, seed: int = 0, kernels: str | None = None) -> Drafter:
    """A drafter with freshly initialised weights (tests, training init); ``kernels`` as in ``DFlashDrafter``."""
    graphdef, params = nnx.split(DFlashDrafter(cfg, dtype=dtype, kernels=kernels, rngs=nnx.Rngs(seed)))
    return Drafter(cfg, graphdef, params)


def check_fits(cfg: DrafterConfig, target_cfg: TargetConfig) -> None:
    """Raises ConfigError listing every way the drafter cannot run on this target."""
    n, D = len(cfg.target_layer_ids), target_cfg.hidden_size
    problems = []
    if cfg.target_hidden_size != D:
        problems.append(f"drafter fc takes {n} x target_hidden_size {cfg.target_hidden_size} = "
                        f"{n * cfg.target_hidden_size} inputs, but {n} taps of the target (hidden_size {D}) "
                        f"give {n * D}")
    if cfg.hidden_size != D:
        problems.append(f"drafter hidden_size {cfg.hidden_size} != target hidden_size {D} (the drafter "
                        f"consumes the target's embeddings and LM head)")
    if cfg.vocab_size != target_cfg.vocab_size:
        problems.append(f"drafter vocab_size {cfg.vocab_size} != target vocab_size {target_cfg.vocab_size}")
    if cfg.mask_token_id >= target_cfg.vocab_size:
        problems.append(f"drafter mask_token_id {cfg.mask_token_id} is not a row of the target's embedding "
                        f"(target vocab_size {target_cfg.vocab_size})")
    bad = [i for i in cfg.target_layer_ids if i >= target_cfg.num_hidden_layers]
    if bad:
        problems.append(f"drafter target_layer_ids {list(cfg.target_layer_ids)} include {bad}, outside the "
                        f"target's layers 0..{target_cfg.num_hidden_layers - 1}")
    if problems:
        raise ConfigError("drafter does not fit the target:\n  " + "\n  ".join(problems))


def load_drafter(path: str | Path, target, *, dtype=None, kernels: str | None = None,
                 progress: bool = True) -> Drafter:
    """Loads a z-lab drafter directory (config.json + model.safetensors) for ``target``.

    Args:
      path: the drafter directory.
      target: a ``dflash_jax.target.Target``; its config is checked against the drafter's.
      dtype: parameter dtype; None uses the target's.
      kernels: kernel mode; None uses the target's.
    """
    path = Path(path)
    cfg = DrafterConfig.from_pretrained(path)
    check_fits(cfg, target.cfg)
    dtype = target.dtype if dtype is None else dtype
    kernels = target.kernels if kernels is None else kernels
    graphdef, abstract = nnx.split(nnx.eval_shape(
        lambda: DFlashDrafter(cfg, dtype=dtype, kernels=kernels, rngs=nnx.Rngs(0))))
    flat = nnx.to_flat_state(abstract)
    expected = {".".join(map(str, p)): v.get_value() for p, v in flat}
    # Some exports ship copies of the target's embedding/head; the drafter always uses the target's own.
    ignore = [r"(model\.)?embed_tokens\.", r"lm_head\."]
    arrays = checkpoint.load_state(path, expected, ignore=ignore, progress=progress)
    params = nnx.from_flat_state([(p, v.replace(arrays[".".join(map(str, p))])) for p, v in flat])
    return Drafter(cfg, graphdef, params)


def save_drafter(path: str | Path, drafter: Drafter) -> None:
    """Writes ``path``/config.json (z-lab format) and ``path``/model.safetensors; ``load_drafter`` reads them."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    atomic.write_text(path / "config.json", json.dumps(drafter.cfg.to_hf(), indent=2))  # each file whole
    tensors = {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(drafter.params)}
    checkpoint.write_safetensors(path / "model.safetensors", tensors, metadata={"format": "pt"})
