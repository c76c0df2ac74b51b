"""The DFlash drafter: target hidden states injected into its KV cache, one pass drafts a whole block.

Sits after ``target.py`` (whose verify/prefill return the "taps": outputs of ``target_layer_ids``)
and is used by ``proposers.py``. The drafter is a small Qwen3 decoder with no embedding or LM head
of its own (it borrows the target's). ``write_context`` turns taps into K/V at the tokens' absolute
positions in every layer's cache (written for all T tokens, committed by ``advance``, like the
target's verify/commit); ``draft_block`` runs the block ``[anchor, mask x (Bk-1)]`` over
``[context ; block]`` in one pass, each layer a ``DrafterLayer`` call. A layer whose queries see a bounded
context (a trained sliding window, or ``--draft-window``'s ``DrafterConfig.draft_window``) reads only that span of
its cache (``context_span``), so its cost does not grow with the context. Training
(``train/drafter.py``) runs this same ``draft_block``, batched over anchors, so there is one layer
forward. The module tree mirrors the z-lab checkpoint keys, so ``load_drafter`` is a plain
key-for-key load.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax import kernels
from dflash_jax.config import ConfigError, DrafterConfig, TargetConfig
from dflash_jax.io import atomic, checkpoint
from dflash_jax.kernels import dispatch
from dflash_jax.models.dflash2 import CandidateSelector, GroupedDynamicCausalConv
from dflash_jax.models.layers import MLP, Linear, RMSNorm, SplitModel, attention
from dflash_jax.models.rope import rotate, rows, table
from dflash_jax.models.target import check_layers, param_dtype

_LAYER_KEY = re.compile(r"(?:model\.)?layers\.(\d+)\.")
# z-lab's released DFlash2 checkpoints store the selector's codebooks without ``.weight`` (its
# ``DFlash2DraftModel.from_pretrained`` maps them); ``save_drafter`` writes the module tree's keys, with it.
CODEBOOK_ALIASES = {f"candidate_selector.{name}": f"candidate_selector.{name}.weight"
                    for name in ("predecessor_codebook", "successor_codebook")}


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
        self.q_proj = Linear(D, N * H, dtype=dtype, kernels=kernels, rngs=rngs, axes=("heads", None))
        self.k_proj = Linear(D, K * H, dtype=dtype, kernels=kernels, rngs=rngs, axes=("kv_heads", None))
        self.v_proj = Linear(D, K * H, dtype=dtype, kernels=kernels, rngs=rngs, axes=("kv_heads", None))
        self.o_proj = Linear(N * H, D, dtype=dtype, kernels=kernels, rngs=rngs, axes=(None, "heads"))
        self.q_norm = RMSNorm(H, cfg.rms_norm_eps, zero_centred=False, dtype=dtype)
        self.k_norm = RMSNorm(H, cfg.rms_norm_eps, zero_centred=False, dtype=dtype)

    def kv(self, h: jax.Array, rot: jax.Array) -> tuple[jax.Array, jax.Array]:
        """K/V of inputs h [B, T, D] whose positions' cos/sin are rot [B, T, 2, H/2]: each [B, T, K, H]."""
        cfg = self.cfg
        B, T, _ = h.shape
        k = rotate(self.k_norm(self.k_proj(h).reshape(B, T, cfg.num_key_value_heads, cfg.head_dim)), rot)
        return k, self.v_proj(h).reshape(B, T, cfg.num_key_value_heads, cfg.head_dim)

    def __call__(self, h: jax.Array, k_cache: jax.Array, v_cache: jax.Array, start: jax.Array, rot: jax.Array, *,
                 causal: bool, window: int | None, context: int | None = None
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The block's attention over ``[context ; block]``.

        Args:
          h: [B, T, D] normed block inputs at positions start[b] + t.
          k_cache, v_cache: [B, K, S, H] / [B, K, H, S] (``kernels.cache_shapes``) holding the context K/V at
            positions [0, start[b]).
          start: [B] int32 committed context length (the block's first position).
          rot: [B, T, 2, H/2] the block positions' cos/sin (``rope.rows``).
          causal, window: the layer's mask rule inside the block and its sliding window (per query).
          context: None, or the most context positions before the block any query sees (``layer_context``):
            the attention then reads only that span of the cache, whatever the context's length.
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
        k_in, v_in, q_start = context_span(k_cache, v_cache, start, T, context)
        o = attention(q, k_in, v_in, q_start, q_start + T, causal=causal, window=window, mode=self.kernels)
        return self.o_proj(o.reshape(B, T, N * H)), k_cache, v_cache


def context_span(k_cache: jax.Array, v_cache: jax.Array, start: jax.Array, T: int, context: int | None
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The cache rows a block of T queries at start[b] + t reads when it sees at most ``context`` positions
    before it: rows [start - context, start + T) (from row 0 while start < context).

    Every attention form then reads context + T keys whatever the context's length: the XLA reference (which
    scores every key it is given), the Triton kernel and the Mosaic one. Keys were rotated at their absolute
    positions when written and attention masks by position differences, so the slice changes no score.

    Args:
      k_cache, v_cache: [B, K, S, H] / [B, K, H, S] with the block's K/V written at rows [start, start + T).
      start: [B] int32 the block's first position (start + T <= S).
    Returns:
      (k [B, K, L, H], v [B, K, H, L], the block's first row in them [B]); L = min(S, context + T). The caches
      unchanged with start when ``context`` is None or the span covers the whole cache.
    """
    S = k_cache.shape[2]
    if context is None or context + T >= S:
        return k_cache, v_cache, start
    span = context + T
    begin = jnp.maximum(start - context, 0)  # [B]; begin + span <= start + T <= S, so no clamping
    k = jax.vmap(lambda c, b: jax.lax.dynamic_slice_in_dim(c, b, span, axis=1))(k_cache, begin)
    v = jax.vmap(lambda c, b: jax.lax.dynamic_slice_in_dim(c, b, span, axis=2))(v_cache, begin)
    return k, v, start - begin


class DrafterLayer(nnx.Module):
    """One Qwen3 decoder layer (pre-norm attention, then pre-norm SwiGLU), with its layer's mask settings;
    in a DFlash2 drafter each sub-layer is wrapped in its ``GroupedDynamicCausalConv`` (``attention_conv``,
    ``mlp_conv``: the normed input convolved before, the output after, over the block)."""

    def __init__(self, cfg: DrafterConfig, index: int, *, dtype, kernels: str, rngs: nnx.Rngs):
        D = cfg.hidden_size
        self.causal = cfg.layer_causal(index)  # static: causal inside the block
        self.window = cfg.layer_window(index)  # static: sliding window or None
        self.context = cfg.layer_context(index)  # static: context positions a query may see, or None (all)
        self.input_layernorm = RMSNorm(D, cfg.rms_norm_eps, zero_centred=False, dtype=dtype)
        self.self_attn = DrafterAttention(cfg, dtype=dtype, kernels=kernels, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(D, cfg.rms_norm_eps, zero_centred=False, dtype=dtype)
        self.mlp = MLP(D, cfg.intermediate_size, dtype=dtype, kernels=kernels, rngs=rngs)
        conv = (lambda: GroupedDynamicCausalConv(cfg, dtype=dtype, kernels=kernels, rngs=rngs)) if cfg.dflash2 else None
        self.attention_conv = conv and conv()  # None in a DFlash drafter
        self.mlp_conv = conv and conv()

    def __call__(self, x: jax.Array, k_cache: jax.Array, v_cache: jax.Array, start: jax.Array,
                 rot: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, T, D] at positions start[b] + t (cos/sin rot) -> (x [B, T, D], caches with the block's K/V written)."""
        h = self.input_layernorm(x)
        if self.attention_conv is not None:
            h, later = self.attention_conv.prepare(h)
        o, k_cache, v_cache = self.self_attn(h, k_cache, v_cache, start, rot, causal=self.causal,
                                               window=self.window, context=self.context)
        if self.attention_conv is not None:
            o = self.attention_conv.finish(o, later)
        x = x + o
        h = self.post_attention_layernorm(x)
        if self.mlp_conv is not None:
            h, later = self.mlp_conv.prepare(h)
        o = self.mlp(h)
        if self.mlp_conv is not None:
            o = self.mlp_conv.finish(o, later)
        return x + o, k_cache, v_cache


class DFlashDrafter(nnx.Module):
    """The z-lab ``DFlashDraftModel`` tree: fc, hidden_norm, layers.{i}, norm (no embedding, no head); a
    DFlash2 drafter (``DFlash2DraftModel``) adds each layer's convolutions and ``candidate_selector``.

    ``kernels`` is the attention kernel mode (None: ``kernels.default_mode()``), a static attribute.
    """

    def __init__(self, cfg: DrafterConfig, *, dtype, kernels: str | None = None, rngs: nnx.Rngs):
        self.cfg = cfg
        self.kernels = kernels = dispatch.resolve(kernels)
        self.fc = Linear(len(cfg.target_layer_ids) * cfg.target_hidden_size, cfg.hidden_size, dtype=dtype,
                         kernels=kernels, rngs=rngs)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centred=False, dtype=dtype)
        self.layers = nnx.List([DrafterLayer(cfg, i, dtype=dtype, kernels=kernels, rngs=rngs)
                                for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centred=False, dtype=dtype)
        self.candidate_selector = (CandidateSelector(cfg, dtype=dtype, kernels=kernels, rngs=rngs)
                                   if cfg.dflash2 else None)


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
    # z-lab's num_target_layers is the depth of the target the drafter was trained on: its taps (and their default,
    # ``default_target_layer_ids``) index that target's layers, the last one read final-normed. On a target of
    # another depth the same ids tap other depths (layer 3 of 4 is the final-normed state, of 8 a middle layer):
    # decoding stays exact, but the drafter reads features it never saw and its drafts are rejected.
    if cfg.num_target_layers != target_cfg.num_hidden_layers:
        problems.append(f"drafter num_target_layers {cfg.num_target_layers} != target num_hidden_layers "
                        f"{target_cfg.num_hidden_layers}: the drafter was trained on a target of "
                        f"{cfg.num_target_layers} layers and its target_layer_ids {list(cfg.target_layer_ids)} "
                        f"index that target's layers (if it was trained on this target, set num_target_layers to "
                        f"{target_cfg.num_hidden_layers} in its config.json)")
    if problems:
        raise ConfigError("drafter does not fit the target:\n  " + "\n  ".join(problems))


def load_drafter(path: str | Path, target, *, dtype=None, kernels: str | None = None, window: int | None = None,
                 progress: bool = True) -> Drafter:
    """Loads a z-lab drafter directory (config.json + model.safetensors) for ``target``.

    Args:
      path: the drafter directory.
      target: a ``dflash_jax.models.target.Target``; its config is checked against the drafter's.
      dtype: parameter dtype; None uses the target's.
      kernels: kernel mode; None uses the target's.
      window: bound the draft context (``--draft-window``): every layer sees at most the last ``window``
        context positions before the block (its causal rule and any trained window kept); None: the whole.
    """
    path = Path(path)
    cfg = DrafterConfig.from_pretrained(path)
    if window is not None:
        cfg = dataclasses.replace(cfg, draft_window=window)  # validated: an integer >= block_size
    check_fits(cfg, target.cfg)
    dtype = target.dtype if dtype is None else param_dtype(dtype)
    kernels = target.kernels if kernels is None else kernels
    check_layers(cfg.num_hidden_layers, checkpoint.checkpoint_files(path), path, _LAYER_KEY)  # before building
    model = nnx.eval_shape(lambda: DFlashDrafter(cfg, dtype=dtype, kernels=kernels, rngs=nnx.Rngs(0)))
    # Some exports ship copies of the target's embedding/head; the drafter always uses the target's own.
    ignore = [r"(model\.)?embed_tokens\.", r"lm_head\."]
    return Drafter(cfg, *checkpoint.load_params(path, model, ignore=ignore, progress=progress,
                                                aliases=CODEBOOK_ALIASES if cfg.dflash2 else {}))


def save_drafter(path: str | Path, drafter: Drafter, *, matrix_dtype=None) -> None:
    """Writes ``path``/config.json (z-lab format) and ``path``/model.safetensors; ``load_drafter`` reads them.
    ``matrix_dtype``: store every matrix (ndim >= 2) in it (e.g. bfloat16), the vectors as they are."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    atomic.write_text(path / "config.json", json.dumps(drafter.cfg.to_hf(), indent=2))  # each file whole
    tensors = checkpoint.matrices_in(((k, a) for k, a, _ in checkpoint.param_tensors(drafter.params)), matrix_dtype)
    checkpoint.write_safetensors(path / "model.safetensors", tensors, metadata={"format": "pt"})
