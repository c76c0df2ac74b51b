"""The building blocks of Qwen3.5 and of the DFlash drafter, as Flax NNX modules.

Sits between the kernels (``dflash_jax.kernels``, which own the hot loops) and the models
(``target.py``, ``drafter.py``). Attribute names mirror the Hugging Face checkpoint keys and weights
keep the checkpoint's orientation (a Linear weight is [out, in]), so a parameter's path is its key;
one exception: the Gated DeltaNet channel rows are stored head-grouped (``gdn_channel_order``), not
in the checkpoint's q | k | v order, so that tensor parallelism can shard them by key-head groups.
Numerics follow transformers: norms and gates in f32, the gated delta rule in f32, softmax in f32.

The layers that call a kernel hold its mode (``kernels``: "reference", "pallas" or "interpret") as a
plain attribute, which NNX keeps in the static graph: it is part of every jit cache key that the
graph is, and ``with_kernels`` gives a model the same weights under another mode. ``Linear`` holds one
too, for the MXFP4 matmul: a projection's weight parameter holds either a dense array or an
``MXFP4Weight`` (``quant.py`` swaps the value, keeping the parameter and its logical axes), and
``Linear`` and ``Experts`` dispatch on that value's type.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax import kernels, parallel
from dflash_jax.config import TargetConfig
from dflash_jax.io import checkpoint
from dflash_jax.kernels import mxfp4
from dflash_jax.kernels.attention_tpu import attention_tpu
from dflash_jax.kernels.moe import grouped_matmul_tpu
from dflash_jax.models.cache import GDNCache, GDNPending, Tree
from dflash_jax.models.rope import rotate

# ---------------------------------------------------------------------------------------------
# Kernel calls. A Pallas kernel is a custom call XLA's partitioner cannot split: traced on a mesh, it runs
# per device on its rows and heads (``parallel.per_head``); the reference path is partitioned like any op.
# Dimension labels: "B" rows, "N" the heads the output follows, "K" the heads each N group shares.

_HEADS, _KV = ("B", None, "N", None), ("B", "K", None, None)  # q / o [B, T, N, H]; caches [B, K, S|H, H|S]
_QK, _V, _GATE, _STATE = ("B", None, "K", None), ("B", None, "N", None), ("B", None, "N"), ("B", "N", None, None)


def _per_device(fn, mode: str, args: tuple, labels: tuple, out_labels, heads: tuple[str, int], shared: tuple[str, int]):
    if kernels.dispatch.resolve(mode) == "reference":
        return fn(*args)
    return parallel.per_head(fn, args, labels, out_labels, heads=heads, shared=shared)


# Queries per row up to which the TPU attention kernel runs (decode, verify, the drafter's block); a prompt's
# attention runs the XLA form (the kernel holds its queries' scores per key block in VMEM). A draft tree's verify
# runs it up to _TPU_TREE_QUERIES tokens (budget 255; 129 tokens hold ~2.6 MB of VMEM at 27B shapes).
_TPU_QUERIES = 64
_TPU_TREE_QUERIES = 256


def attention(q, k_cache, v_cache, start, end, *, causal: bool, mode: str, window: int | None = None, tree=None):
    """``kernels.attention`` of q [B, T, N, H] over the caches' keys [start, end) per row -> [B, T, N, H]; in a
    TPU mode the Mosaic kernel (``kernels.attention_tpu``) for T <= ``_TPU_QUERIES``. ``tree`` [B, T, T] bool
    (a draft tree's mask, ``cache.Tree.mask``) replaces the causal mask: the Mosaic kernel with the mask in a TPU
    mode (T <= ``_TPU_TREE_QUERIES``), else the XLA form (the Pallas GPU modes say so once in the log)."""
    limit = _TPU_QUERIES if tree is None else _TPU_TREE_QUERIES
    args, labels = (q, k_cache, v_cache, start, end), (_HEADS, _KV, _KV, ("B",), ("B",))
    if tree is not None:
        args, labels = args + (tree,), labels + (("B", None, None),)
    if kernels.dispatch.is_tpu(mode):
        if q.shape[1] > limit:
            with kernels.dispatch.generic():
                return kernels.attention(q, k_cache, v_cache, start, end, causal=causal, window=window,
                                         impl="reference", tree=tree)
        fn = lambda *a: attention_tpu(*a, causal=causal, window=window,  # noqa: E731
                                      interpret=mode == "tpu-interpret")
    else:
        fn = lambda q, k, v, start, end, tree=None: kernels.attention(  # noqa: E731 -- tree: the 6th arg when given
            q, k, v, start, end, causal=causal, window=window, impl=mode, tree=tree)
    return _per_device(fn, mode, args, labels, _HEADS, heads=("heads", q.shape[2]),
                       shared=("kv_heads", k_cache.shape[1]))


def _gdn(fn, mode: str, args: tuple, labels: tuple, out_labels, k, v, *, tpu_form: bool = False):
    """A GDN kernel per device; in a TPU mode only where it has a TPU form (the verify), else the XLA reference,
    partitioned like any op."""
    if kernels.dispatch.is_tpu(mode) and not tpu_form:
        with kernels.dispatch.generic():
            return fn(*args)
    return _per_device(fn, mode, args, labels, out_labels, heads=("v_heads", v.shape[2]),
                       shared=("k_heads", k.shape[2]))


def _normal(rngs: nnx.Rngs, shape, dtype, axes=None, std=0.02):
    """An N(0, std^2) parameter with its logical axes (``parallel.param``; None: replicated)."""
    return parallel.param((std * jax.random.normal(rngs.params(), shape)).astype(dtype), axes)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MXFP4Weight:
    """An MXFP4 weight (``kernels.mxfp4``'s format), the value a projection's parameter holds in place of the
    dense [..., out, in] array: e2m1 ``codes`` uint8 [..., out, in/2] (two per byte) and e8m0 ``scale`` uint8
    [..., out, in/32] (one per 32 inputs). Both split along the parameter's logical axes (a shard of whole heads
    is whole 32-input scale blocks). Checkpoint keys are Quark's: the codes at the parameter's key, the scales
    at ``<key>_scale`` (``checkpoint.tensor_keys``). ``input_scale_mode``: dynamic MXFP4 activations
    (``mxfp4.qdq_mxfp4`` of the input, Quark's ``input_tensors``) or None (weight-only); a static field, so part
    of the parameter tree's structure and of every jit cache key."""

    codes: jax.Array
    scale: jax.Array
    input_scale_mode: str | None = dataclasses.field(default=None, metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        """The dense weight's shape [..., out, in]."""
        return (*self.codes.shape[:-1], 2 * self.codes.shape[-1])

    @classmethod
    def quantize(cls, w, scale_mode: str, input_scale_mode: str | None) -> MXFP4Weight:
        """``w`` [..., out, in] quantized (``mxfp4.quantize_mxfp4``); a ShapeDtypeStruct (an abstract model,
        ``nnx.eval_shape``) gives the shapes only."""
        if isinstance(w, jax.ShapeDtypeStruct):
            lead, K = w.shape[:-1], w.shape[-1]
            return cls(jax.ShapeDtypeStruct((*lead, K // 2), jnp.uint8),
                       jax.ShapeDtypeStruct((*lead, K // mxfp4.BLOCK), jnp.uint8), input_scale_mode)
        return cls(*mxfp4.quantize_mxfp4(w, scale_mode), input_scale_mode)

    def dequantize(self, dtype) -> jax.Array:
        return mxfp4.dequantize_mxfp4(self.codes, self.scale, dtype)


class Linear(nnx.Module):
    """``y = x W^T`` with W stored [out, in] as in PyTorch checkpoints; no bias. ``axes``: W's logical axes
    (out, in), e.g. ("heads", None) for a column-parallel projection; None: replicated. W is a dense array or
    an ``MXFP4Weight``, which runs ``mxfp4.mxfp4_linear`` in the kernel mode ``kernels``."""

    def __init__(self, din: int, dout: int, *, dtype, kernels: str, rngs: nnx.Rngs, axes=None):
        self.kernels = kernels
        self.weight = _normal(rngs, (dout, din), dtype, axes)

    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.weight.get_value()
        if isinstance(w, MXFP4Weight):
            impl = self.kernels if parallel.traced_mesh() is None else "reference"  # a custom call is not split
            return mxfp4.mxfp4_linear(x, w.codes, w.scale, input_scale_mode=w.input_scale_mode, impl=impl)
        return jnp.einsum("...i,oi->...o", x, w)


class Embedding(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, dtype, rngs: nnx.Rngs):
        self.weight = _normal(rngs, (vocab, dim), dtype, ("vocab", None))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], tokens, axis=0)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis.

    ``zero_centred=True`` is Qwen3.5's norm: ``x_hat * (1 + w)`` computed in f32 and cast last (the
    checkpoint stores offsets from 1). ``zero_centred=False`` is the Qwen3 norm used by the drafter:
    ``w * x_hat``, with x_hat cast to the input dtype first.
    """

    def __init__(self, dim: int, eps: float, *, zero_centred: bool, dtype):
        self.eps = eps
        self.zero_centred = zero_centred
        self.weight = nnx.Param(jnp.zeros((dim,), dtype) if zero_centred else jnp.ones((dim,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        if self.zero_centred:
            return (h * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        return self.weight[...] * h.astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """GDN output norm: per head over Dv with a plain (not zero-centred) weight, then ``* silu(z)``."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x: jax.Array, z: jax.Array) -> jax.Array:
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        h = self.weight[...] * h.astype(x.dtype)
        return (h * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, dim: int, hidden: int, *, dtype, kernels: str, rngs: nnx.Rngs):
        self.gate_proj = Linear(dim, hidden, dtype=dtype, kernels=kernels, rngs=rngs, axes=("mlp", None))
        self.up_proj = Linear(dim, hidden, dtype=dtype, kernels=kernels, rngs=rngs, axes=("mlp", None))
        self.down_proj = Linear(hidden, dim, dtype=dtype, kernels=kernels, rngs=rngs, axes=(None, "mlp"))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nnx.Module):
    """Routed experts in the fused checkpoint layout: gate_up_proj [E, 2I, D], down_proj [E, D, I], each a dense
    array or an ``MXFP4Weight``."""

    def __init__(self, num: int, dim: int, hidden: int, *, dtype, rngs: nnx.Rngs):
        self.gate_up_proj = _normal(rngs, (num, 2 * hidden, dim), dtype, ("experts", None, None))
        self.down_proj = _normal(rngs, (num, dim, hidden), dtype, ("experts", None, None))

    def project(self, name: str, x: jax.Array, group_sizes: jax.Array, impl: str) -> jax.Array:
        """x [M, Din] rows sorted by expert times the experts' ``name`` weight -> [M, Dout]."""
        w = getattr(self, name).get_value()
        if isinstance(w, MXFP4Weight):
            if w.input_scale_mode is not None:
                x = mxfp4.qdq_mxfp4(x, w.input_scale_mode)
            with kernels.dispatch.generic():  # no TPU form: the XLA reference in a TPU mode
                return mxfp4.mxfp4_grouped_matmul(x, w.codes, w.scale, group_sizes, impl=impl)
        if kernels.dispatch.is_tpu(impl):  # the Mosaic kernel: reads only the experts with rows
            return grouped_matmul_tpu(x, w, group_sizes, interpret=impl == "tpu-interpret")
        return kernels.grouped_matmul(x, w, group_sizes, impl=impl)


class SparseMoeBlock(nnx.Module):
    """Qwen3.5 MoE: softmax over all experts (f32), top-k, renormalise; plus a sigmoid-gated shared expert."""

    def __init__(self, cfg: TargetConfig, *, dtype, kernels: str, rngs: nnx.Rngs):
        D = cfg.hidden_size
        self.kernels = kernels
        self.top_k = cfg.num_experts_per_tok
        self.gate = Linear(D, cfg.num_experts, dtype=dtype, kernels=kernels, rngs=rngs)
        self.experts = Experts(cfg.num_experts, D, cfg.moe_intermediate_size, dtype=dtype, rngs=rngs)
        self.shared_expert = MLP(D, cfg.shared_expert_intermediate_size, dtype=dtype, kernels=kernels, rngs=rngs)
        self.shared_expert_gate = Linear(D, 1, dtype=dtype, kernels=kernels, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [M, D]
        # On a mesh the experts are split over devices and this runs once per device (parallel.py).
        routed = parallel.over_experts(self._routed, x, self.experts, self.gate)
        shared = jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return (routed + shared).reshape(shape)

    def _routed(self, x: jax.Array, experts: Experts, gate: Linear, first) -> jax.Array:
        """x [M, D] through the experts ``experts`` holds, global ids first .. first + E_l - 1 (all of
        them on one device): their weighted sum per token [M, D]; tokens routed elsewhere add zero."""
        probs = jax.nn.softmax(gate(x).astype(jnp.float32), axis=-1)
        weights, chosen = jax.lax.top_k(probs, self.top_k)  # [M, k] global expert ids
        weights = (weights / weights.sum(-1, keepdims=True)).astype(x.dtype)
        num = experts.gate_up_proj.shape[0]  # E_l
        local = chosen - first
        mine = (local >= 0) & (local < num)
        # Sort the (token, expert) pairs by expert so each expert sees one contiguous group of rows;
        # pairs for other devices' experts sort last, past every group (the kernels give them zeros).
        flat = jnp.where(mine, local, num).reshape(-1)
        order = jnp.argsort(flat, stable=True)
        token = order // self.top_k
        tpu = kernels.dispatch.is_tpu(self.kernels)
        # libtpu's cost model charges a bincount -2 s (the whole program's estimate turns negative) and a row
        # gather ~6x a one-hot product's bytes at 16 tokens: on a TPU the forms it costs as what they move (the
        # product up to _TPU_QUERIES tokens; past that, a prompt's, it would cost M^2 x k x D)
        if tpu:
            sizes = jnp.sum(flat[:, None] == jnp.arange(num, dtype=flat.dtype), axis=0, dtype=jnp.int32)
        else:
            sizes = jnp.bincount(flat, length=num + 1)[:num].astype(jnp.int32)
        if tpu and x.shape[0] <= _TPU_QUERIES:
            rows = jax.nn.one_hot(token, x.shape[0], dtype=x.dtype) @ x  # [M*k, D], exact: one 1 per row
        else:
            rows = x[token]
        h = experts.project("gate_up_proj", rows, sizes, self.kernels)  # [M*k, 2I]
        I = h.shape[-1] // 2
        h = jax.nn.silu(h[:, :I]) * h[:, I:]
        y = experts.project("down_proj", h, sizes, self.kernels)  # [M*k, D]
        y = y * jnp.where(mine, weights, 0).reshape(-1)[order][:, None]
        return jnp.zeros_like(x).at[token].add(y)


class GatedAttention(nnx.Module):
    """Qwen3.5 full attention: per-head interleaved query/gate, q/k norms, partial RoPE, GQA, sigmoid gate."""

    def __init__(self, cfg: TargetConfig, *, dtype, kernels: str, rngs: nnx.Rngs):
        D, N, K, H = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.cfg = cfg
        self.kernels = kernels
        self.q_proj = Linear(D, N * H * 2, dtype=dtype, kernels=kernels, rngs=rngs, axes=("heads", None))
        self.k_proj = Linear(D, K * H, dtype=dtype, kernels=kernels, rngs=rngs, axes=("kv_heads", None))
        self.v_proj = Linear(D, K * H, dtype=dtype, kernels=kernels, rngs=rngs, axes=("kv_heads", None))
        self.o_proj = Linear(N * H, D, dtype=dtype, kernels=kernels, rngs=rngs, axes=(None, "heads"))
        self.q_norm = RMSNorm(H, cfg.rms_norm_eps, zero_centred=True, dtype=dtype)
        self.k_norm = RMSNorm(H, cfg.rms_norm_eps, zero_centred=True, dtype=dtype)

    def __call__(self, x, k_cache, v_cache, start, rot, tree=None):
        """Attends T new tokens at positions start[b] + t over the cache, writing their K/V first.

        Args:
          x: [B, T, D]; k_cache [B, K, S, H], v_cache [B, K, H, S] (``kernels.cache_shapes``); start: [B]
            int32 (tokens already cached); rot: [B, T, 2, R/2] the positions' cos/sin (``rope.rows``).
          tree: [B, T, T] bool, a draft tree's ancestor mask (``cache.Tree.mask``) in place of the causal
            one: token t sees the cache and its own ancestors (its rot then holds start + depth).
        Returns:
          ([B, T, D], k_cache, v_cache) with rows [start, start + T) written.
        """
        cfg = self.cfg
        B, T, _ = x.shape
        N, K, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qg = self.q_proj(x).reshape(B, T, N, 2 * H)
        q, gate = qg[..., :H], qg[..., H:].reshape(B, T, N * H)
        q = rotate(self.q_norm(q), rot)
        k = rotate(self.k_norm(self.k_proj(x).reshape(B, T, K, H)), rot)
        v = self.v_proj(x).reshape(B, T, K, H)
        k_cache, v_cache = kernels.write_cache(k_cache, v_cache, k, v, start)
        o = attention(q, k_cache, v_cache, start, start + T, causal=True, mode=self.kernels, tree=tree)
        o = o.reshape(B, T, N * H) * jax.nn.sigmoid(gate)
        return self.o_proj(o), k_cache, v_cache


class DepthwiseConv(nnx.Module):
    """Holds the causal depthwise conv weight [C, 1, K] (applied in ``GatedDeltaNet._prepare``)."""

    def __init__(self, channels: int, taps: int, *, dtype, rngs: nnx.Rngs):
        self.weight = _normal(rngs, (channels, 1, taps), dtype, ("gdn_channels", None, None), std=taps**-0.5)


def gdn_channel_order(cfg: TargetConfig) -> np.ndarray:
    """The GDN channel permutation ``order`` [C] with internal = hf[order] (C = 2*Hk*Dk + Hv*Dv).

    The HF checkpoint orders the channels q heads | k heads | v heads. The layer keeps them grouped
    by key head: for g = 0 .. Hk-1 the block [q head g (Dk) | k head g (Dk) | v heads g*r .. g*r+r-1
    (r*Dv)], r = Hv // Hk (value head j reads key head j // r). A contiguous shard of whole groups holds
    whole q, k and v heads for every model axis that divides Hk (``parallel.RULES["gdn_channels"]``).
    """
    Hk, Dk, Dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = cfg.linear_num_value_heads // Hk
    q = np.arange(Hk * Dk).reshape(Hk, Dk)
    v = 2 * Hk * Dk + np.arange(Hk * r * Dv).reshape(Hk, r * Dv)
    return np.concatenate([q, q + Hk * Dk, v], axis=1).reshape(-1)  # [Hk, 2*Dk + r*Dv] -> [C]


def gdn_channels(cfg: TargetConfig, key: str, host: np.ndarray, axes: tuple[str | None, ...], *,
                 to_hf: bool = False) -> np.ndarray:
    """A checkpoint tensor (``key``, logical ``axes`` as its parameter declared them: ``parallel.param_axes``)
    with its GDN channel rows (axis 0) put in the layer's order (HF -> internal), or back with ``to_hf``; other
    tensors unchanged. The GDN channel tensors are those whose axis 0 is the logical axis ``gdn_channels``
    (the fused q|k|v projection, MXFP4: its packed codes and per-row scales, and the depthwise conv weight).
    The load path applies it to each tensor as it is read, ``hf_tensors`` before the safetensors writers write."""
    if axes[:1] != ("gdn_channels",):  # [:1]: a 0-d tensor has no axis 0
        return host
    order = gdn_channel_order(cfg)
    if host.shape[0] != order.size:
        raise ValueError(f"{key}: {host.shape[0]} rows, but the GDN channel axis of this config has {order.size} "
                         f"(2 x {cfg.linear_num_key_heads} x {cfg.linear_key_head_dim} + "
                         f"{cfg.linear_num_value_heads} x {cfg.linear_value_head_dim})")
    return host[np.argsort(order) if to_hf else order]


def hf_tensors(cfg: TargetConfig, params: nnx.State) -> Iterator[tuple[str, np.ndarray]]:
    """A target's parameters as HF checkpoint tensors, one (key, host array) at a time, as stored (dtype,
    fused experts, MXFP4 codes and scales at their keys: ``checkpoint.param_tensors``), with the GDN channels
    back in the checkpoint's q | k | v order (``gdn_channels``); a consumer that converts each keeps one host
    copy of it, not two."""
    for key, a, v in checkpoint.param_tensors(params):
        yield key, gdn_channels(cfg, key, np.asarray(a), parallel.param_axes(v), to_hf=True)


class GatedDeltaNet(nnx.Module):
    """Qwen3.5 linear attention: causal depthwise conv + SiLU on q/k/v, then the gated delta rule.

    The recurrent state cannot be cropped after a speculative verify, so the layer owns its part
    of speculation: ``verify`` reads the cache without writing it and records each token's key,
    write and decay (``GDNPending``); ``commit`` applies the first n of them to the old state in
    closed form (``kernels.gdn_replay``) and slides the conv window (the invariant is stated in
    ``target.py``).

    The channel axis C of ``in_proj_qkv`` rows, ``conv1d`` channels, the conv window and the pending
    conv inputs is in the head-grouped order of ``gdn_channel_order``, not the checkpoint's q | k | v:
    loading permutes those tensors, the safetensors writers permute them back (``gdn_channels``), and
    orbax copies of the parameters hold this order.
    """

    def __init__(self, cfg: TargetConfig, *, dtype, kernels: str, rngs: nnx.Rngs):
        D, C, Hv = cfg.hidden_size, cfg.conv_dim, cfg.linear_num_value_heads
        self.cfg = cfg
        self.kernels = kernels
        self.in_proj_qkv = Linear(D, C, dtype=dtype, kernels=kernels, rngs=rngs, axes=("gdn_channels", None))
        self.in_proj_z = Linear(D, cfg.linear_value_dim, dtype=dtype, kernels=kernels, rngs=rngs,
                                axes=("v_heads", None))
        self.in_proj_b = Linear(D, Hv, dtype=dtype, kernels=kernels, rngs=rngs, axes=("v_heads", None))
        self.in_proj_a = Linear(D, Hv, dtype=dtype, kernels=kernels, rngs=rngs, axes=("v_heads", None))
        self.conv1d = DepthwiseConv(C, cfg.linear_conv_kernel_dim, dtype=dtype, rngs=rngs)
        # Decay parameters stay f32 whatever the model dtype: they feed exp() of a cumulative sum.
        self.A_log = parallel.param(jnp.log(jax.random.uniform(rngs.params(), (Hv,), minval=1.0, maxval=16.0)),
                                    ("v_heads",))
        self.dt_bias = parallel.param(jnp.ones((Hv,), jnp.float32), ("v_heads",))
        self.norm = GatedRMSNorm(cfg.linear_value_head_dim, cfg.rms_norm_eps, dtype=dtype)
        self.out_proj = Linear(cfg.linear_value_dim, D, dtype=dtype, kernels=kernels, rngs=rngs,
                               axes=(None, "v_heads"))

    def _prepare(self, x, conv_window, *, speculative: bool, up=None):
        """Projections, conv and gates for T tokens following ``conv_window`` ([B, K-1, C] raw inputs).

        ``up`` (a draft tree's ``cache.Tree.up`` [B, T, >= K]): each token's conv reads its own ancestors'
        inputs (then the window's, past the root), not its slot neighbours'; None: the chain.

        ``speculative`` (verify's T <= block tokens) on the XLA path (kernels "reference") computes the
        causal conv as a contraction over the taps, which XLA materializes, instead of a sum of shifted
        products, which XLA on CPU fuses into every consumer. It was ~1/4 of a plain-decoding step while
        the one-token commit fused its inputs into the state update per element (``gdn_replay_reference``
        now keeps that a dot); since then it is 1-2% faster per step on the shipped pair (2026-12-02,
        within noise). Everywhere else the sum: on prompts it is ~20% faster (the stacked windows cost a
        copy), and on the Pallas path the conv's outputs feed kernels, which take them materialized, while
        the stack would read and write four windows of inputs per token in HBM (Qwen3.5-27B, batch 32: the
        verify's bytes 1.135x a decode's with it, 1.055x without; perf_model).

        Channels are head-grouped (``gdn_channel_order``): C = Hk groups of [q (Dk) | k (Dk) | v (r*Dv)].
        Returns q, k [B,T,Hk,Dk] (L2-normalised, q scaled), v [B,T,Hv,Dv], g, beta [B,T,Hv] f32,
        z [B,T,Hv,Dv] and the raw conv inputs ``mixed`` [B,T,C].
        """
        cfg = self.cfg
        B, T, _ = x.shape
        Hk, Hv, Dk, Dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                          cfg.linear_key_head_dim, cfg.linear_value_head_dim)
        mixed = self.in_proj_qkv(x)
        full = jnp.concatenate([conv_window.astype(mixed.dtype), mixed], axis=1)  # [B, K-1+T, C]
        w = self.conv1d.weight[...][:, 0, :]  # [C, K]; tap K-1 multiplies the current token
        taps = w.shape[1]
        if up is not None:  # tap j reads the (K-1-j)-th ancestor: full's row K-1 + up (up < 0: the window)
            at = (taps - 1) + up[:, :, taps - 1::-1]  # [B, T, K]
            # as a one-hot product, not a row gather: on a TPU the gather moved 24x the bytes (72 MB per 27B layer
            # at 65 tokens); each sum over s has one nonzero term, so the result is the gather's
            pick = (at[..., None] == jnp.arange(full.shape[1])).astype(full.dtype)  # [B, T, K, K-1+T]
            y = jnp.einsum("btjs,bsc,cj->btc", pick, full, w)
        elif speculative and self.kernels == "reference":  # a contraction, which XLA materializes (docstring)
            y = jnp.einsum("btjc,cj->btc", jnp.stack([full[:, j:j + T, :] for j in range(taps)], 2), w)
        else:
            y = sum(full[:, j:j + T, :] * w[:, j] for j in range(taps))
        y = jax.nn.silu(y).reshape(B, T, Hk, -1)  # [B, T, Hk, 2*Dk + r*Dv]: one group per key head
        q = y[..., :Dk].astype(jnp.float32)
        k = y[..., Dk:2 * Dk].astype(jnp.float32)
        v = y[..., 2 * Dk:].reshape(B, T, Hv, Dv)  # value heads g*r .. g*r+r-1 of group g, in order
        q = q * jax.lax.rsqrt(jnp.sum(q * q, -1, keepdims=True) + 1e-6) * (Dk**-0.5)
        k = k * jax.lax.rsqrt(jnp.sum(k * k, -1, keepdims=True) + 1e-6)
        beta = jax.nn.sigmoid(self.in_proj_b(x)).astype(jnp.float32)
        a = self.in_proj_a(x).astype(jnp.float32)
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(a + self.dt_bias[...])
        z = self.in_proj_z(x).reshape(B, T, Hv, Dv)
        return q, k, v, g, beta, z, mixed

    def _output(self, o, z, dtype):
        B, T = o.shape[:2]
        return self.out_proj(self.norm(o.astype(dtype), z).reshape(B, T, -1))

    def prefill(self, x, lengths, cache: GDNCache | None = None) -> tuple[jax.Array, GDNCache]:
        """A right-padded prompt batch (or the next chunk of one), by the chunked form.

        Args:
          x: [B, P, D]; lengths: [B] real tokens per row (positions >= length are padding).
          cache: the committed conv window and state the tokens follow (a prompt's earlier chunks); None: empty.
        Returns:
          ([B, P, D], the cache after exactly lengths[b] tokens: conv window [B, K-1, C], state f32).
        """
        cfg = self.cfg
        B, P, _ = x.shape
        if cache is None:
            cache = GDNCache(conv=jnp.zeros((B, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), x.dtype),
                             state=jnp.zeros((B, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                              cfg.linear_value_head_dim), jnp.float32))
        window, state0 = cache.conv, cache.state
        q, k, v, g, beta, z, mixed = self._prepare(x, window, speculative=False)
        real = (jnp.arange(P)[None, :] < lengths[:, None])[..., None]  # [B, P, 1]
        g, beta = jnp.where(real, g, 0.0), jnp.where(real, beta, 0.0)  # padding leaves the state as is
        run = lambda *a: kernels.gdn_chunked(*a, impl=self.kernels)  # noqa: E731
        o, state = _gdn(run, self.kernels, (q, k, v, g, beta, state0), (_QK, _QK, _V, _GATE, _GATE, _STATE),
                        (_V, _STATE), k, v)
        return self._output(o, z, x.dtype), GDNCache(conv=slide_window(window, mixed, lengths), state=state)

    def verify(self, x, cache: GDNCache, tree: Tree | None = None) -> tuple[jax.Array, GDNCache]:
        """T speculative tokens [B, T, D]: reads the cache, writes nothing.

        ``tree``: the tokens form a draft tree (``cache.Tree``), not a chain: each token's conv reads its
        ancestors and its delta rule runs along its own root -> token path (``kernels.gdn_verify``'s
        tree form: the TPU kernel in a TPU mode, else the XLA form); the pending inputs are per token as for
        a chain, and the commit replays the accepted path's (``target.commit``).
        Returns ([B, T, D], the same conv window and state with the update inputs pending).
        """
        up = None if tree is None else tree.up
        q, k, v, g, beta, z, mixed = self._prepare(x, cache.conv, speculative=True, up=up)
        args, labels = (q, k, v, g, beta, cache.state), (_QK, _QK, _V, _GATE, _GATE, _STATE)
        if tree is None:
            run = lambda *a: kernels.gdn_verify(*a, impl=self.kernels)  # noqa: E731
        else:  # the mask [B, T, T] rides along, split by row
            run = lambda *a: kernels.gdn_verify(*a[:-1], impl=self.kernels, tree=a[-1],  # noqa: E731
                                                tree_depth=tree.max_depth)
            args, labels = args + (tree.mask,), labels + (("B", None, None),)
        o, u = _gdn(run, self.kernels, args, labels, (_V, _V), k, v, tpu_form=True)
        pending = GDNPending(mixed=mixed, k=k, u=u, g=g, kernels=self.kernels)
        return self._output(o, z, x.dtype), GDNCache(conv=cache.conv, state=cache.state, pending=pending)

    @staticmethod
    def commit(cache: GDNCache, n: jax.Array) -> GDNCache:
        """Keeps the first n[b] ([B] int32 in 0..T) pending tokens: adds their writes to the decayed state
        (read once, written once) and slides the conv window past them. The replay runs in the kernel
        mode the verify ran in, which the pending record carries (statically)."""
        p = cache.pending
        if p is None:
            raise ValueError("commit: a Gated DeltaNet cache has no pending verify inputs (call verify first)")
        run = lambda *a: kernels.gdn_replay(*a, impl=p.kernels)  # noqa: E731
        state = _gdn(run, p.kernels, (p.k, p.u, p.g, cache.state, n), (_QK, _V, _GATE, _STATE, ("B",)), _STATE,
                     p.k, p.u)
        return GDNCache(conv=slide_window(cache.conv, p.mixed, n), state=state)


def slide_window(window: jax.Array, mixed: jax.Array, n: jax.Array) -> jax.Array:
    """The conv window after the first n[b] of T new inputs: the last K-1 raw inputs up to that token.

    Args:
      window: [B, K-1, C] inputs before the new tokens; mixed: [B, T, C]; n: [B] in 0..T.
    """
    full = jnp.concatenate([window, mixed.astype(window.dtype)], axis=1)  # [B, K-1+T, C]
    return jax.vmap(lambda f, s: jax.lax.dynamic_slice_in_dim(f, s, window.shape[1], axis=0))(full, n)


def with_kernels(model: nnx.Module, mode: str) -> nnx.Module:
    """A copy of ``model`` (same weight arrays) whose kernel-calling layers all run in ``mode``."""
    mode = kernels.dispatch.check(mode, "with_kernels")
    model = nnx.merge(*nnx.split(model))
    for _, m in nnx.iter_modules(model):
        if hasattr(m, "kernels"):
            m.kernels = mode
    return model


class SplitModel:
    """What ``Target`` and ``Drafter`` share: a model held as a frozen dataclass of ``graphdef`` (static)
    and ``params`` (a pytree), merged back into its NNX module on demand."""

    def module(self) -> nnx.Module:
        return nnx.merge(self.graphdef, self.params)

    @property
    def kernels(self) -> str:
        """The kernel mode the graph was built with (static: part of every jit cache key): the root module's
        attribute. nnx exposes a graph's attributes only on the merged module (no array is copied: 29 ms for
        the 27B target's graph, read once by ``load_drafter`` and ``MTPProposer.of``)."""
        return self.module().kernels

    def with_kernels(self, mode: str):
        """The same model (same parameter arrays) running its kernel-calling layers in mode ``mode``."""
        return dataclasses.replace(self, graphdef=nnx.graphdef(with_kernels(self.module(), mode)))
