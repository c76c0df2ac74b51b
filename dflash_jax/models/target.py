"""The Qwen3.5 target model (dense and MoE) and its speculative cache protocol: prefill, verify, commit.

Sits on top of ``layers.py`` and ``cache.py`` and below the proposers and the loop. The NNX modules
mirror the HF checkpoint tree, so a parameter's path is its checkpoint key; but the Gated DeltaNet
channel rows (``in_proj_qkv``, ``conv1d``) are head-grouped (``layers.gdn_channel_order``), not the
checkpoint's q | k | v: ``load_target`` permutes them as it reads, ``layers.hf_tensors`` back. At
jit boundaries the model is a pure function of ``(graphdef, params)``: ``prefill`` and ``verify``
merge them inside the trace. Both return the hidden states of requested layers ("taps": HF's
``hidden_states[i + 1]``, the output of layer i, except that for the last layer it is the final-normed
state, as transformers records it and z-lab's drafters read it), which the DFlash drafter consumes.

The invariant of speculation, which ``prefill``, ``verify`` and ``commit`` below keep together:
``verify(tokens[B, T], cache)`` processes T tokens per row without deciding what is kept, and
``commit(cache, n[B])`` keeps exactly the first n[b] of them per row, bit-for-bit the cache of having
processed only those n[b] tokens. Full-attention layers: verify writes K/V rows [len, len + T),
commit only advances ``lengths`` (rejected rows are masked by length and overwritten later). Gated
DeltaNet layers (``GatedDeltaNet.verify``/``.commit``): verify reads the state and conv window
without writing them and records each token's update (``GDNPending``); commit applies the first n
of them to the old state (in closed form) and slides the conv window. Decoding one token is verify(T=1)
followed by commit(1). ``verify`` and ``commit`` donate the cache they are given, so a step updates
it in place instead of copying it (the Pallas replay also aliases the state it rewrites).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax import parallel
from dflash_jax.config import ConfigError, TargetConfig, read_target_config
from dflash_jax.io import atomic, checkpoint
from dflash_jax.kernels import dispatch as kernel_modes
from dflash_jax.models import quant, rope
from dflash_jax.models.cache import (
    AttentionCache,
    GDNCache,
    GDNPending,
    TargetCache,
    Tree,
    init_cache,
    split_pending,
    with_pending,
)
from dflash_jax.models.layers import (
    MLP,
    Embedding,
    GatedAttention,
    GatedDeltaNet,
    Linear,
    RMSNorm,
    SparseMoeBlock,
    SplitModel,
    gdn_channels,
)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: TargetConfig, kind: str, *, dtype, kernels: str, rngs: nnx.Rngs):
        D = cfg.hidden_size
        self.input_layernorm = RMSNorm(D, cfg.rms_norm_eps, zero_centred=True, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(D, cfg.rms_norm_eps, zero_centred=True, dtype=dtype)
        if kind == "full_attention":
            self.self_attn = GatedAttention(cfg, dtype=dtype, kernels=kernels, rngs=rngs)
        else:
            self.linear_attn = GatedDeltaNet(cfg, dtype=dtype, kernels=kernels, rngs=rngs)
        if cfg.is_moe:
            self.mlp = SparseMoeBlock(cfg, dtype=dtype, kernels=kernels, rngs=rngs)
        else:
            self.mlp = MLP(D, cfg.intermediate_size, dtype=dtype, kernels=kernels, rngs=rngs)

    def _mlp_residual(self, x, h):
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))

    def attend(self, x, cache: AttentionCache, start, rot, tree: Tree | None = None):
        """Full-attention layer over new tokens at positions start[b] + t (cos/sin ``rot``); writes their K/V.
        A ``tree``'s tokens see the cache and their own ancestors."""
        h, k, v = self.self_attn(self.input_layernorm(x), cache.k, cache.v, start, rot,
                                 None if tree is None else tree.mask)
        return self._mlp_residual(x, h), AttentionCache(k, v)

    def gdn_prefill(self, x, lengths, cache: GDNCache):
        """GDN layer over a right-padded prompt (or its next chunk) from the committed ``cache``."""
        h, cache = self.linear_attn.prefill(self.input_layernorm(x), lengths, cache)
        return self._mlp_residual(x, h), cache

    def gdn_verify(self, x, cache: GDNCache, tree: Tree | None = None):
        """GDN layer over speculative tokens (a chain, or a ``tree``): the cache is read, the update inputs
        are kept pending."""
        h, cache = self.linear_attn.verify(self.input_layernorm(x), cache, tree)
        return self._mlp_residual(x, h), cache


class TextModel(nnx.Module):
    def __init__(self, cfg: TargetConfig, *, dtype, kernels: str, rngs: nnx.Rngs, layers: bool = True):
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, t, dtype=dtype, kernels=kernels, rngs=rngs)
                                for t in (cfg.layer_types if layers else ())])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centred=True, dtype=dtype)


class MTP(nnx.Module):
    """Qwen3.5's multi-token-prediction head (``mtp.*``): fc([norm(embed), norm(hidden)]) -> one layer."""

    def __init__(self, cfg: TargetConfig, *, dtype, kernels: str, rngs: nnx.Rngs):
        D = cfg.hidden_size
        self.fc = Linear(2 * D, D, dtype=dtype, kernels=kernels, rngs=rngs)
        self.pre_fc_norm_embedding = RMSNorm(D, cfg.rms_norm_eps, zero_centred=True, dtype=dtype)
        self.pre_fc_norm_hidden = RMSNorm(D, cfg.rms_norm_eps, zero_centred=True, dtype=dtype)
        self.layers = nnx.List([DecoderLayer(cfg, "full_attention", dtype=dtype, kernels=kernels, rngs=rngs)
                                for _ in range(cfg.mtp_num_hidden_layers)])
        self.norm = RMSNorm(D, cfg.rms_norm_eps, zero_centred=True, dtype=dtype)


class Qwen35ForCausalLM(nnx.Module):
    """The whole target; ``kernels`` is the kernel mode of every layer (None: ``kernels.default_mode()``)."""

    def __init__(self, cfg: TargetConfig, *, dtype=jnp.float32, mtp: bool = False, kernels: str | None = None,
                 rngs: nnx.Rngs, layers: bool = True):
        self.cfg = cfg
        self.kernels = kernels = kernel_modes.resolve(kernels)
        self.model = TextModel(cfg, dtype=dtype, kernels=kernels, rngs=rngs, layers=layers)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(
            cfg.hidden_size, cfg.vocab_size, dtype=dtype, kernels=kernels, rngs=rngs, axes=("vocab", None))
        self.mtp = MTP(cfg, dtype=dtype, kernels=kernels, rngs=rngs) if mtp and cfg.mtp_num_hidden_layers else None

    def logits(self, h: jax.Array) -> jax.Array:
        """LM head on final-normed hidden states [..., D] -> [..., V] (``lm_logits``, as the proposers' view)."""
        head = None if self.lm_head is None else self.lm_head.weight[...]
        return lm_logits(h, self.model.embed_tokens.weight[...], head)


def lm_logits(h: jax.Array, embedding: jax.Array, lm_head: jax.Array | None) -> jax.Array:
    """The target's LM head, for the target (``Qwen35ForCausalLM.logits``) and its proposers (``TargetView``)
    alike: final-normed hidden states h [..., D] -> logits [..., V] against ``lm_head`` [V, D], or against
    the embedding [V, D] when the head is tied (None). The head is a dense matrix (quant keeps it so)."""
    head = embedding if lm_head is None else lm_head
    if head.ndim != 2 or head.shape[1] != h.shape[-1]:
        raise ValueError(f"the LM head must be a dense [V, {h.shape[-1]}] matrix for hidden states {h.shape}, got "
                         f"{head.shape} (an MXFP4-packed head is not supported: quantization_config.exclude "
                         "must cover lm_head)")
    return jnp.einsum("...d,vd->...v", h, head)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TargetOutput:
    logits: jax.Array  # prefill: [B, V] at each row's last real token; verify: [B, T, V]
    taps: jax.Array  # [B, T, len(taps) * D]: the requested layer outputs, concatenated
    hidden: jax.Array  # [B, T, D] final-normed hidden states


def _run(model: Qwen35ForCausalLM, tokens, cache: TargetCache, lengths, taps, tree: Tree | None = None):
    """Shared body of prefill and extend (``lengths`` given: GDN by the chunked form from the cache's state) and
    verify (``lengths`` None; a ``tree``'s tokens at positions start + depth)."""
    x = model.model.embed_tokens(tokens)
    start = cache.lengths
    if tree is None:  # once for every attention layer, as transformers does
        rot = rope.rows(cache.rope, start, tokens.shape[1])
    else:
        rot = cache.rope[start[:, None] + tree.depths]
    new_layers, tapped = [], {}
    for i, (layer, c) in enumerate(zip(model.model.layers, cache.layers, strict=True)):
        with jax.named_scope(f"layer{i}"):
            if isinstance(c, AttentionCache):
                x, c = layer.attend(x, c, start, rot, tree)
            elif lengths is not None:
                x, c = layer.gdn_prefill(x, lengths, c)
            else:
                x, c = layer.gdn_verify(x, c, tree)
        new_layers.append(c)
        if i in taps:
            tapped[i] = x
    hidden = model.model.norm(x)
    if len(new_layers) - 1 in taps:  # HF's hidden_states[L] is the final-normed state, not the last layer's output
        tapped[len(new_layers) - 1] = hidden
    tap_out = jnp.concatenate([tapped[i] for i in taps], axis=-1) if taps else jnp.zeros(
        x.shape[:2] + (0,), x.dtype)
    return hidden, tap_out, new_layers


@functools.partial(jax.jit, static_argnames=("graphdef", "capacity", "taps"))
def prefill(graphdef, params, tokens, lengths, *, capacity: int, taps: tuple[int, ...] = ()):
    """Processes a right-padded prompt batch into a fresh cache.

    Args:
      graphdef, params: ``nnx.split`` of a ``Qwen35ForCausalLM``.
      tokens: [B, P] int32, row b real up to lengths[b]; lengths: [B] int32 in 1..P.
      capacity: cache length S (static), >= P.
      taps: layer ids whose outputs are returned (static).
    Returns:
      (TargetOutput with logits [B, V] at each row's last real token, TargetCache with lengths).
    """
    model = nnx.merge(graphdef, params)
    if tokens.shape[1] > capacity:
        raise ValueError(f"prefill: prompt bucket {tokens.shape[1]} exceeds cache capacity {capacity}")
    return _continue(model, tokens, lengths, init_cache(model.cfg, tokens.shape[0], capacity,
                                                       model.model.embed_tokens.weight.dtype), taps)


@functools.partial(jax.jit, static_argnames=("graphdef", "taps"), donate_argnames=("cache",))
def extend(graphdef, params, tokens, lengths, cache: TargetCache, *, taps: tuple[int, ...] = ()):
    """Continues a prefill: the next chunk of each row's prompt after the ``cache.lengths`` tokens processed so far.

    The same computation as ``prefill`` (attention over the cache and the chunk, the Gated DeltaNet layers by the
    chunked form from the committed state and conv window), so a prompt prefilled in chunks has the cache of
    prefilling it whole (up to float rounding). Nothing is pending: the chunk is kept, no commit follows.

    Args:
      tokens: [B, T] int32, row b real up to lengths[b] (in 1..T); cache: a committed TargetCache with
        lengths + T <= capacity (the K/V of the padding is written and masked by length). Donated like
        ``verify``'s.
    Returns:
      (TargetOutput with logits [B, V] at each row's last real token and taps / hidden [B, T, ...], the cache
      with lengths + lengths[b]).
    """
    return _continue(nnx.merge(graphdef, params), tokens, lengths, cache, taps)


def _continue(model: Qwen35ForCausalLM, tokens, lengths, cache: TargetCache, taps):
    lengths = lengths.astype(jnp.int32)
    hidden, tap_out, layers = _run(model, tokens, cache, lengths, taps)
    last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, D]
    out = TargetOutput(logits=model.logits(last), taps=tap_out, hidden=hidden)
    return out, dataclasses.replace(cache, lengths=cache.lengths + lengths, layers=tuple(layers))


@functools.partial(jax.jit, static_argnames=("graphdef", "taps", "tree_depth"), donate_argnames=("cache",))
def verify(graphdef, params, tokens, cache: TargetCache, *, taps: tuple[int, ...] = (), parents=None,
           tree_depth: int | None = None):
    """Runs T tokens per row at positions lengths[b] + t, deciding nothing.

    Args:
      tokens: [B, T] int32; cache: a committed TargetCache (callers keep lengths + T <= capacity).
        It is donated (its K/V rows are updated in place, not copied): do not use it afterwards;
        pass ``jax.tree.map(jnp.copy, cache)`` to keep it.
      parents: None (the tokens are a chain) or [B, T] int32, a draft tree: token t's parent index
        (< t; the root's, parents[:, 0], is ignored). Token t is then at position lengths[b] + its depth and
        sees the cache and its own ancestors in every layer (``tree_of``): its logits and taps are those
        of its root -> t path run alone as a chain. Its K/V still go to row lengths[b] + t.
      tree_depth: (static, with ``parents``) no token is deeper than this below the root (a draft tree's
        block - 1): the tree's ancestors and its GDN solve then take that many rounds, not T - 1.
    Returns:
      (TargetOutput with logits [B, T, V], the cache with K/V rows written and GDN inputs pending);
      pass it to ``commit(cache, n)`` (a chain) or ``commit(cache, n, path)`` (a tree).
    """
    model = nnx.merge(graphdef, params)
    tree = None if parents is None else tree_of(parents, model.cfg.linear_conv_kernel_dim, tree_depth)
    hidden, tap_out, layers = _run(model, tokens, cache, None, taps, tree)
    out = TargetOutput(logits=model.logits(hidden), taps=tap_out, hidden=hidden)
    return out, dataclasses.replace(cache, layers=tuple(layers))


def commit(cache: TargetCache, n: jax.Array, path: jax.Array | None = None) -> TargetCache:
    """Keeps exactly the first n[b] tokens of the last verify in each row (of a tree: of ``path``).

    Args:
      cache: the cache returned by ``verify`` (its GDN layers carry ``pending``). Donated like
        ``verify``'s: the K/V, conv windows and states are reused in place.
      n: [B] int32 in 0..T (a tree: 0..P).
      path: None (the verify ran a chain: its first n tokens are kept) or [B, P] int32, P <= T, the kept
        root -> node path of a tree's verify as token indices (path[:, 0] = 0, each the parent of the next;
        entries from n[b] on are ignored). Attention K/V of the path move to consecutive rows, the GDN
        layers replay the path's pending inputs (the chain's closed-form commit on gathered inputs) and
        their conv windows end at the path's last inputs: the cache of having processed the path alone.
    Returns:
      The cache as if only those tokens had been processed, with nothing pending.
    """
    # Only what the result reuses is donated; the pending inputs are read by the replay, then dropped.
    return _commit(*split_pending(cache), jnp.asarray(n, jnp.int32), None if path is None else
                   jnp.asarray(path, jnp.int32))


@functools.partial(jax.jit, donate_argnames=("cache",))
def _commit(cache: TargetCache, pending: tuple, n: jax.Array, path: jax.Array | None) -> TargetCache:
    cache = with_pending(cache, pending)
    if path is not None:
        cache = _gather_path(cache, path)
    layers = tuple(GatedDeltaNet.commit(c, n) if isinstance(c, GDNCache) else c for c in cache.layers)
    return dataclasses.replace(cache, lengths=cache.lengths + n, layers=layers)


def _gather_path(cache: TargetCache, path: jax.Array) -> TargetCache:
    """A tree verify's cache as if it had verified the chain of tokens ``path`` [B, P]: attention K/V rows
    lengths + path[j] copied to lengths + j, the GDN pending inputs gathered along the path."""
    start = cache.lengths

    def rows(x, axis):  # x [B, K, S, H] (axis 2) or [B, K, H, S] (axis 3): rows start + path, written at start
        at = jnp.expand_dims(start[:, None] + path, tuple(a for a in range(1, 4) if a != axis))
        kept = jnp.take_along_axis(x, at, axis=axis)
        return jax.vmap(lambda c, r, s: jax.lax.dynamic_update_slice_in_dim(c, r, s, axis=axis - 1))(x, kept, start)

    def pending(p: GDNPending) -> GDNPending:
        take = lambda x: jnp.take_along_axis(x, path.reshape(path.shape + (1,) * (x.ndim - 2)), axis=1)  # noqa: E731
        return dataclasses.replace(p, mixed=take(p.mixed), k=take(p.k), u=take(p.u), g=take(p.g))

    layers = tuple(AttentionCache(rows(c.k, 2), rows(c.v, 3)) if isinstance(c, AttentionCache)
                   else dataclasses.replace(c, pending=pending(c.pending)) for c in cache.layers)
    return dataclasses.replace(cache, layers=layers)


def tree_of(parents: jax.Array, ancestors: int, max_depth: int | None = None) -> Tree:
    """The ``Tree`` of parent indices [B, T] (parents[:, t] < t for t >= 1; the root's is ignored), with each
    token's first ``ancestors`` ancestors (itself first) for the Gated DeltaNet conv (its kernel width);
    ``max_depth`` (static): no token is deeper (None: T - 1)."""
    B, T = parents.shape
    parents = parents.astype(jnp.int32).at[:, 0].set(-1)
    idx = jnp.arange(T, dtype=jnp.int32)

    def hop(ptr):  # each pointer to its parent; past the root, one more input back into the conv window
        return jnp.where(ptr >= 0, jnp.take_along_axis(parents, jnp.maximum(ptr, 0), axis=1), ptr - 1)

    ptr = jnp.broadcast_to(idx, (B, T))
    up = [ptr]
    for _ in range(1, ancestors):
        up.append(hop(up[-1]))

    def climb(_, carry):  # every ancestor, one generation per trip (at most T - 1)
        ptr, mask = carry
        ptr = hop(ptr)
        return ptr, mask | (ptr[..., None] == idx)

    depth = T - 1 if max_depth is None else min(max_depth, T - 1)
    _, mask = jax.lax.fori_loop(0, depth, climb, (ptr, ptr[..., None] == idx))
    return Tree(depths=mask.sum(-1, dtype=jnp.int32) - 1, mask=mask, up=jnp.stack(up, axis=-1), max_depth=depth)


def forward(graphdef, params, tokens, *, taps: tuple[int, ...] = ()) -> TargetOutput:
    """Full-sequence forward without a cache (training, scoring): logits [B, T, V] at every position.

    Differentiable; uses the same layers as prefill (chunked GDN) on unpadded rows.
    """
    model = nnx.merge(graphdef, params)
    B, T = tokens.shape
    cache = init_cache(model.cfg, B, T, model.model.embed_tokens.weight.dtype)
    hidden, tap_out, _ = _run(model, tokens, cache, jnp.full((B,), T, jnp.int32), taps)
    return TargetOutput(logits=model.logits(hidden), taps=tap_out, hidden=hidden)


@dataclasses.dataclass(frozen=True)
class Target(SplitModel):
    """A loaded target: config, the static graph and its parameters (a pytree); ``module()`` is the
    ``Qwen35ForCausalLM``, ``kernels`` / ``with_kernels`` the kernel mode of its layers."""

    cfg: TargetConfig
    graphdef: nnx.GraphDef
    params: nnx.State

    @property
    def dtype(self):
        return self.params["model"]["embed_tokens"]["weight"].get_value().dtype

    def prefill(self, tokens, lengths, *, capacity: int, taps: tuple[int, ...] = ()):
        return prefill(self.graphdef, self.params, jnp.asarray(tokens, jnp.int32),
                       jnp.asarray(lengths, jnp.int32), capacity=capacity, taps=tuple(taps))

    def verify(self, tokens, cache: TargetCache, *, taps: tuple[int, ...] = (), parents=None,
               tree_depth: int | None = None):
        if parents is not None:
            parents = jnp.asarray(parents, jnp.int32)
            if parents.shape != jnp.shape(tokens):
                raise ValueError(f"verify: parents {parents.shape} must match tokens {jnp.shape(tokens)}")
            if not isinstance(parents, jax.core.Tracer) and bool(
                    (parents[:, 1:] >= jnp.arange(1, parents.shape[1])).any() | (parents[:, 1:] < 0).any()):
                raise ValueError("verify: parents must precede their children (0 <= parents[:, t] < t for t >= 1)")
        return verify(self.graphdef, self.params, jnp.asarray(tokens, jnp.int32), cache, taps=tuple(taps),
                      parents=parents, tree_depth=tree_depth)

    @staticmethod
    def commit(cache: TargetCache, n, path=None) -> TargetCache:
        return commit(cache, n, path)


PARAM_DTYPES = ("float32", "bfloat16")


def param_dtype(dtype, what: str = "dtype"):
    """``dtype`` as a jnp dtype if parameters can be held in it (float32, bfloat16), else a ValueError saying why."""
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        raise ValueError(f"{what} {dtype!r} is not a dtype; expected one of {PARAM_DTYPES}") from None
    if name == "float16":
        raise ValueError(f"{what} float16 is not supported: Qwen3.5's activations exceed float16's range (max 65504) "
                         "and would turn to inf; use bfloat16 (the same size, float32's range) or float32")
    if name not in PARAM_DTYPES:
        raise ValueError(f"{what} {name} is not supported for parameters; expected one of {PARAM_DTYPES}"
                         + (" (MXFP4 weights: load an MXFP4 checkpoint or pass quantized=True)"
                            if jnp.issubdtype(name, jnp.integer) else ""))
    return jnp.dtype(name)


def _abstract_model(cfg: TargetConfig, dtype, mtp: bool, kernels: str | None):
    """The model with ShapeDtypeStructs for parameters, built in time linear in the layer count: one trace of
    the whole model grows quadratically (every traced RNG draw walks the trace so far), so the shell (embedding,
    head, MTP) is traced without its decoder layers and each layer kind once, cloned per layer."""
    kernels = kernel_modes.resolve(kernels)
    model = nnx.eval_shape(lambda: Qwen35ForCausalLM(cfg, dtype=dtype, mtp=mtp, kernels=kernels, rngs=nnx.Rngs(0),
                                                     layers=False))
    kinds = {kind: nnx.eval_shape(lambda kind=kind: DecoderLayer(cfg, kind, dtype=dtype, kernels=kernels,
                                                                 rngs=nnx.Rngs(0)))
             for kind in dict.fromkeys(cfg.layer_types)}
    model.model.layers = nnx.List([nnx.clone(kinds[kind]) for kind in cfg.layer_types])
    return model


def init_target(cfg: TargetConfig, *, dtype=jnp.float32, mtp: bool = False, seed: int = 0,
                kernels: str | None = None) -> Target:
    """A target with freshly initialised weights (tests, pretraining); ``kernels`` as in ``load_target``."""
    graphdef, params = nnx.split(Qwen35ForCausalLM(cfg, dtype=dtype, mtp=mtp, kernels=kernels,
                                                   rngs=nnx.Rngs(seed)))
    return Target(cfg, graphdef, params)


CONVERTED = "params.orbax"  # a converted checkpoint: config.json + this orbax directory
GDN_LAYOUT = "head-grouped"  # the converted copy's GDN channel order (``layers.gdn_channel_order``)


def load_target(path: str | Path, dtype=jnp.bfloat16, *, mtp: bool | None = None, kernels: str | None = None,
                progress: bool = True, mesh: jax.sharding.Mesh | None = None,
                quantized: bool | None = None) -> Target:
    """Loads a Qwen3.5 HF checkpoint directory (either layout, dense or MoE) without torch.

    Args:
      path: directory with config.json and model.safetensors (or sharded + index.json), or a
        converted copy written by ``save_converted`` (restored as saved; ``dtype``/``mtp`` ignored).
      dtype: parameter dtype (the GDN decay parameters stay f32).
      mtp: load the ``mtp.*`` head; None loads it when the checkpoint has one.
      kernels: kernel mode ("reference", "pallas", "interpret"); None: ``kernels.default_mode()``
        (``DFLASH_KERNELS``, else pallas on a GPU). ``Target.with_kernels`` changes it later.
      mesh: place each tensor straight onto its shards of this mesh (by the logical axes its parameter declares,
        ``parallel.param``); None: one device.
      quantized: MXFP4 projections (True; a dense checkpoint is quantized as ``QuantConfig()``
        says) or dense ones (False; an MXFP4 checkpoint is dequantized to ``dtype``); None: as stored.
        An MXFP4 checkpoint is AMD Quark's layout (``quantization_config``, see quant.py).
    """
    path = Path(path)
    dtype = param_dtype(dtype)
    if path.is_file():
        raise ValueError(f"{path} is a file; a checkpoint is the directory holding config.json and the safetensors "
                         f"(here {path.parent})")
    converted = (path / CONVERTED).is_dir()
    if converted:
        checkpoint.verify(path, "conversion")  # before anything in it is read
    cfg, qcfg = read_target_config(path)  # qcfg None: a dense checkpoint
    if converted:
        meta = checkpoint.read_meta(path / CONVERTED)
        checkpoint.check_meta(path, meta, {"gdn_channels": GDN_LAYOUT},
                              "a converted copy without it holds the Gated DeltaNet channels in the checkpoint's "
                              "q | k | v order: convert it again from the HF checkpoint")
        model = _abstract_model(cfg, jnp.dtype(meta["dtype"]), meta["mtp"], kernels)
        quant.restore_layout(model, meta.get("mxfp4"))
        graphdef, abstract = nnx.split(model)
        if mesh is not None:
            abstract = parallel.abstract_on(abstract, mesh, cfg)
        target = Target(cfg, graphdef, checkpoint.restore_params(path / CONVERTED / "params", abstract))
        return target if quantized is None else quant.convert(target, quantized)
    files = checkpoint.checkpoint_files(path)
    check_layers(cfg.num_hidden_layers, files, path)  # before the model is built: a wrong layer count fails in a moment
    has_mtp = any(k.startswith("mtp.") for k in files)
    use_mtp = bool(cfg.mtp_num_hidden_layers) and (has_mtp if mtp is None else mtp)
    model = _abstract_model(cfg, dtype, use_mtp, kernels)
    if qcfg is not None:
        try:
            quant.quantize_modules(model, qcfg)  # the stored layout: packed weights + scales where quantized
        except ConfigError as e:
            raise ConfigError(f"{path / 'config.json'}: {e}") from None
    ignore = [r"model\.visual\.", r"model\.language_model\.visual\.", r"visual\."]
    if not use_mtp:
        ignore.append(r"mtp\.")
    if cfg.tie_word_embeddings:
        ignore.append(re.escape("lm_head.weight"))
    axes = parallel.axes_by_key(nnx.state(model))
    put = checkpoint.to_device if mesh is None else parallel.loader(mesh, cfg, axes)

    def place(key, host):  # GDN channels into the layer's order on the host, before any device sees them
        return put(key, gdn_channels(cfg, key, host, axes[key]))

    target = Target(cfg, *checkpoint.load_params(path, model, ignore=ignore, place=place, progress=progress))
    return target if quantized is None else quant.convert(target, quantized)


_LAYER_KEY = re.compile(r"model\.(?:language_model\.)?layers\.(\d+)\.")


def check_layers(num_layers: int, keys, path, pattern: re.Pattern = _LAYER_KEY) -> None:
    """Refuses a checkpoint whose decoder layers (the keys ``pattern`` numbers) are not exactly config.json's
    0..num_hidden_layers - 1: found from the key names alone, before a model of that many layers is built."""
    held = sorted({int(m.group(1)) for k in keys if (m := pattern.match(k))})
    if held != list(range(num_layers)):
        extra = [i for i in held if i >= num_layers]
        missing = sorted(set(range(num_layers)) - set(held))
        what = (f"tensors of {len(held)} decoder layers" + (f" (up to layer {held[-1]})" if held else "")
                + (f"; missing layers {_spans(missing)}" if missing else "")
                + (f"; extra layers {_spans(extra)}" if extra else ""))
        raise checkpoint.CheckpointError(f"{path}: config.json says num_hidden_layers={num_layers}, but the "
                                         f"checkpoint holds {what}")


def _spans(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> '0..2, 5' (at most a few spans shown)."""
    spans, start = [], None
    for a, b in zip(ids, ids[1:] + [None], strict=True):
        start = a if start is None else start
        if b != a + 1:
            spans.append(f"{start}..{a}" if a != start else str(a))
            start = None
    return ", ".join(spans[:5]) + (", ..." if len(spans) > 5 else "")


def save_converted(target: Target, source: str | Path, path: str | Path, *, overwrite: bool = False) -> None:
    """Writes a fast converted copy of a loaded target: its config.json (and tokenizer files) from
    ``source`` plus the parameters as an orbax checkpoint, restored bit-exactly by ``load_target``.
    The orbax tree holds the parameters as the model does: GDN channels head-grouped (``GatedDeltaNet``).

    The copy replaces ``path`` atomically (``atomic.directory_writer``: an interrupted write keeps the
    previous copy, a concurrent second writer fails, a ``path`` that is, holds or lies in ``source`` is refused,
    and a non-empty directory that is not an earlier copy only with ``overwrite``) and carries a manifest of its
    files' checksums, verified on load."""
    source = Path(source)

    def converted(p: Path) -> bool:  # an earlier copy (finished or not) may be replaced, a user's folder not
        return (p / CONVERTED).is_dir() or (p / atomic.MANIFEST).is_file()

    with atomic.directory_writer(path, replaces=converted, what="converted copy", source=source,
                                 writer="dflash_jax save_converted", overwrite=overwrite) as tmp:
        for f in source.iterdir():
            if f.is_file() and not f.name.startswith("model") and f.suffix in (".json", ".txt", ".model", ".jinja") \
                    and f.name not in (atomic.MARKER, atomic.MANIFEST):
                shutil.copy(f, tmp / f.name)
        checkpoint.save_orbax(tmp / CONVERTED / "params", target.params)
        meta = {"dtype": str(target.dtype), "mtp": target.module().mtp is not None,
                "mxfp4": quant.layout(target.module()), "gdn_channels": GDN_LAYOUT}
        checkpoint.write_meta(tmp / CONVERTED, meta)
        atomic.write_manifest(tmp)
