"""Where every array lives on a device mesh: one table of logical axes, mapped onto mesh axes.

Sits under the parameter trees (``models/``, which declare their axes here) and the loop: loading places
each tensor on its shards with ``param_shardings``, and the loop (``SpeculativeLoop(mesh=...)``)
traces its phases under the mesh (``mesh_context``) and pins its state (caches, proposer state,
per-row arrays) to ``state_shardings`` after init and every step (``pin_state``); inside jit, XLA's
SPMD partitioner (GSPMD) splits the dense computation to match. A cache written and read inside one
phase (the MTP head's, in propose's scan) is pinned where it is written (``constrain_cache``). The
explicit ``shard_map``s are the routed MoE experts (``over_experts``) and the per-head Pallas kernels
(``dflash_jax/kernels/dispatch.per_head``, on this table's layout). Nothing here is specific to one device
count: without a mesh (or on a 1x1x1 one) the code is the single-device code.

The mesh has three axes (``AXES``): ``data`` splits batch rows (data parallel), ``model`` splits
heads, MLP width and vocabulary (tensor parallel, Megatron style: column-parallel in-projections,
row-parallel out-projections, so each layer costs one all-reduce of its [B, T, D] output; the
vocab-parallel LM head's greedy argmax reduces a per-shard max and first index, never the logits), and
``expert`` splits the routed experts together with ``model``. Logical axes (``RULES``) name what a
tensor dimension is. Each parameter declares its logical axes where the model creates it (``param``: NNX
variable metadata, beside the weight) and ``param_shardings`` derives every sharding from them with one tree
map; ``CACHES`` gives every cache field its logical axes, once.

A logical axis is sharded only when the mesh axes divide its unit count (heads, not head x
head_dim channels), else it is replicated and ``Layout.replicated`` says so. For Qwen3.5-27B at
TP=8: 24 query heads, 48 GDN value heads and 16 GDN key heads (with the GDN channels, grouped by key
head) shard; its 4 KV heads do not, so k_proj/v_proj and the attention K/V caches are replicated on
every model shard.

Several processes (hosts): ``cli.args.mesh_from_args`` joins them with ``jax.distributed.initialize`` from
the CLI's flags or the environment JAX documents, and ``host`` gathers rows spread over processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dflash_jax.io import checkpoint

if TYPE_CHECKING:
    from dflash_jax.config import DrafterConfig, TargetConfig

AXES = ("data", "model", "expert")

# Logical axis -> mesh axis. Logical names not listed (the residual width D, head_dim, the cache
# length S) are never sharded.
RULES: dict[str, str | tuple[str, ...]] = {
    "batch": "data",  # rows of a batch: prompts, caches, loop state
    "vocab": "model",  # embedding rows and LM head rows (vocab-parallel)
    "heads": "model",  # attention query heads N (q_proj rows with their gates, o_proj columns)
    "kv_heads": "model",  # attention KV heads K (k/v_proj rows, the K/V caches)
    "v_heads": "model",  # GDN value heads Hv (z/a/b projections, decay, out_proj, the state [B, Hv, Dk, Dv])
    "k_heads": "model",  # GDN key heads Hk (the L2-normalised keys kept pending by a verify)
    # GDN channels C (in_proj_qkv rows, conv1d channels, the conv window, the pending conv inputs), stored
    # head-grouped (layers.gdn_channel_order): Hk groups [q_g | k_g | v heads of g], so the unit is a key head
    # and a shard holds whole q, k and v heads. A model axis that does not divide Hk replicates them.
    "gdn_channels": "model",
    "mlp": "model",  # MLP width F (dense MLP, shared expert, drafter MLP)
    # Routed experts E over the model and expert axes together (vLLM's expert parallel: EP = TP x EP
    # devices), so a TP-only mesh holds each expert once, not once per model shard.
    "experts": ("model", "expert"),
}

# Cache pytree class -> {field: logical axes}. Keyed by class name (cache.py's, the drafter's DraftCache,
# mtp.py's MTPState) so that this module sits below every model module in the import graph. Fields not
# listed hold per-row values and follow the default rule of ``state_shardings``.
CACHES: dict[str, dict[str, tuple[str | None, ...]]] = {
    "AttentionCache": {"k": ("batch", "kv_heads", None, None), "v": ("batch", "kv_heads", None, None)},
    "GDNCache": {"conv": ("batch", None, "gdn_channels"), "state": ("batch", "v_heads", None, None)},
    "GDNPending": {"mixed": ("batch", None, "gdn_channels"), "k": ("batch", None, "k_heads", None),
                   "u": ("batch", None, "v_heads", None), "g": ("batch", None, "v_heads")},
    "MTPState": {"k": ("batch", "kv_heads", None, None), "v": ("batch", "kv_heads", None, None),
                 "rope": (None, None, None)},
    "DraftCache": {"k": ("batch", "kv_heads", None, None), "v": ("batch", "kv_heads", None, None),
                   "rope": (None, None, None)},
    "TargetCache": {"rope": (None, None, None)},  # the position table: no rows
}
_DRAFT_CACHES = ("DraftCache",)  # laid out by the drafter's heads, not the target's


def make_mesh(*, data: int = 1, model: int = 1, expert: int = 1, devices=None) -> Mesh:
    """A (data, model, expert) mesh over ``devices`` (default: all, across every process).

    Axes are ``Auto``: the partitioner propagates shardings from the ones we pin, and the model code
    runs unchanged.
    """
    devices = jax.devices() if devices is None else list(devices)
    shape = (data, model, expert)
    if min(shape) < 1 or int(np.prod(shape)) != len(devices):
        raise ValueError(f"mesh data={data} x model={model} x expert={expert} = {int(np.prod(shape))} devices, "
                         f"but {len(devices)} are available (--data-parallel-size x --tensor-parallel-size x "
                         f"--expert-parallel-size must equal the device count)")
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)


def is_drafter(cfg) -> bool:
    return hasattr(cfg, "target_layer_ids")  # a DrafterConfig (duck-typed: no import of drafter.py)


def unit_counts(cfg: TargetConfig | DrafterConfig) -> dict[str, int]:
    """Logical axis -> how many indivisible units lie along it (a shard must hold whole heads)."""
    counts = {"heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads, "vocab": cfg.vocab_size}
    if not is_drafter(cfg):
        counts |= {"v_heads": cfg.linear_num_value_heads, "k_heads": cfg.linear_num_key_heads,
                   "gdn_channels": cfg.linear_num_key_heads}  # whole key-head groups
        if cfg.is_moe:
            counts["experts"] = cfg.num_experts
    return counts


@dataclasses.dataclass(frozen=True)
class Layout:
    """The rules resolved for one model on one mesh: logical axes -> ``PartitionSpec``/``NamedSharding``."""

    mesh: Mesh
    counts: Mapping[str, int]  # from ``unit_counts``; axes not listed need only divide the dimension

    @classmethod
    def of(cls, cfg: TargetConfig | DrafterConfig, mesh: Mesh) -> Layout:
        return cls(mesh, unit_counts(cfg))

    def mesh_axis(self, logical: str | None, dim: int | None = None) -> str | tuple[str, ...] | None:
        """The mesh axis (or axes) for a logical axis, or None (replicated) when they do not divide it."""
        axis = _used(self.mesh, RULES.get(logical))
        if axis is None:
            return None
        size = mesh_size(self.mesh, axis)
        units = self.counts.get(logical, dim)
        if (units is not None and units % size) or (dim is not None and dim % size):
            return None
        return axis

    def spec(self, logical: tuple[str | None, ...], shape: tuple[int, ...]) -> P:
        if len(logical) != len(shape):
            raise ValueError(f"logical axes {logical} do not fit an array of shape {shape}")
        return P(*(self.mesh_axis(name, dim) for name, dim in zip(logical, shape, strict=True)))

    def sharding(self, logical: tuple[str | None, ...], shape: tuple[int, ...]) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical, shape))

    def replicated(self) -> list[str]:
        """Human-readable list of the logical axes this mesh cannot shard, and why."""
        out = []
        for name, units in sorted(self.counts.items()):
            axis = _used(self.mesh, RULES[name])
            if axis is not None and units % mesh_size(self.mesh, axis):
                out.append(f"{name} ({units}) replicated: not divisible by the {axis} axis "
                           f"({mesh_size(self.mesh, axis)})")
        return out


def _used(mesh: Mesh, axis: str | tuple[str, ...] | None) -> str | tuple[str, ...] | None:
    """The mesh axes of a rule that have more than one device (a name, a tuple of names, or None)."""
    names = (axis,) if isinstance(axis, str) else tuple(axis or ())
    names = tuple(a for a in names if mesh.shape[a] > 1)
    return None if not names else names[0] if len(names) == 1 else names


def mesh_size(mesh: Mesh, axis: str | tuple[str, ...]) -> int:
    """Devices along a mesh axis (or the product over a tuple of axes)."""
    return int(np.prod([mesh.shape[a] for a in ((axis,) if isinstance(axis, str) else axis)]))


def param(value, axes: tuple[str | None, ...] | None = None) -> nnx.Param:
    """A parameter declaring its logical axes (``RULES`` names, one per dimension) as NNX variable metadata
    (``logical_axes``), read back by ``param_axes``; without axes it is replicated."""
    if axes is None:
        return nnx.Param(value)
    if len(axes) != value.ndim:
        raise ValueError(f"logical axes {axes} do not fit a parameter of shape {value.shape}")
    return nnx.Param(value, logical_axes=tuple(axes))


def param_axes(variable: nnx.Variable) -> tuple[str | None, ...]:
    """The logical axes a parameter declared (``param``): all None (replicated) when it declared none."""
    return variable.get_metadata().get("logical_axes") or (None,) * len(variable.shape)


def axes_by_key(params) -> dict[str, tuple[str | None, ...]]:
    """Checkpoint key (``checkpoint.param_tensors``) -> its parameter's logical axes, for an ``nnx.State``."""
    return {key: param_axes(v) for key, _, v in checkpoint.param_tensors(params)}


def param_shardings(params, layout: Layout):
    """A pytree of NamedShardings matching ``params`` (an ``nnx.State`` of arrays or ShapeDtypeStructs),
    each parameter's from the logical axes it declared; every array of a pytree-valued parameter (an MXFP4
    weight's codes [out, in/2] and scales [out, in/32]) split along the same axes."""
    def shardings(v):
        axes = param_axes(v)
        return v.replace(jax.tree.map(lambda a: layout.sharding(axes, a.shape), v.get_value()))

    return jax.tree.map(shardings, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def place(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """Puts a host array onto its shards: each device receives only its own slice (every process
    calls this with the same array and fills just its addressable devices)."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def loader(mesh: Mesh, cfg: TargetConfig | DrafterConfig, axes: Mapping[str, tuple[str | None, ...]]):
    """The ``place`` callback of ``checkpoint.load_state``: each tensor, by its key, straight onto its shards
    (``axes``: ``axes_by_key`` of the abstract model being filled)."""
    layout = Layout.of(cfg, mesh)
    return lambda key, host: place(host, layout.sharding(axes[key], host.shape))


def abstract_on(abstract, mesh: Mesh, cfg: TargetConfig | DrafterConfig):
    """ShapeDtypeStructs of an abstract parameter tree with their shardings (orbax restores onto them)."""
    shardings = param_shardings(abstract, Layout.of(cfg, mesh))
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def state_shardings(state, batch: int, target: Layout, draft: Layout | None = None):
    """NamedShardings for a loop state (or any cache pytree) of ``batch`` rows.

    Cache types in ``CACHES`` follow their table (``DraftCache`` with the drafter's layout); any other
    array whose leading dimension is ``batch`` is split over rows, everything else is replicated.
    """
    def row_sharding(x):
        if x.ndim and x.shape[0] == batch:
            return target.sharding(("batch",) + (None,) * (x.ndim - 1), x.shape)
        return NamedSharding(target.mesh, P())

    def node(x):
        fields = CACHES.get(type(x).__name__)
        if fields is None:
            return row_sharding(x)
        layout = (draft or target) if type(x).__name__ in _DRAFT_CACHES else target
        out = {}
        for f in dataclasses.fields(x):
            value = getattr(x, f.name)
            if f.metadata.get("static"):  # e.g. GDNPending.kernels: part of the tree's structure
                out[f.name] = value
            elif f.name in fields:
                out[f.name] = jax.tree.map(lambda a, axes=fields[f.name]: layout.sharding(axes, a.shape), value)
            else:
                out[f.name] = state_shardings(value, batch, target, draft)
        return type(x)(**out)

    return jax.tree.map(node, state, is_leaf=lambda x: type(x).__name__ in CACHES)


def constrain_state(state, batch: int, target: Layout, draft: Layout | None = None):
    """``with_sharding_constraint`` of a loop state to ``state_shardings`` (inside jit)."""
    return jax.lax.with_sharding_constraint(state, state_shardings(state, batch, target, draft))


def layouts(mesh: Mesh, cfg: TargetConfig, proposer=None) -> tuple[Layout, Layout | None]:
    """(the target's layout, the drafter's or None) for a loop of ``cfg`` and ``proposer`` on ``mesh``."""
    draft_cfg = getattr(proposer, "cfg", None)
    return Layout.of(cfg, mesh), Layout.of(draft_cfg, mesh) if is_drafter(draft_cfg) else None


def shard_params(params, mesh: Mesh | None, cfg: TargetConfig, proposer=None):
    """Places loop params ``(target params, proposer params)`` on ``mesh`` by their axes (already placed
    leaves move only if their sharding differs; no mesh: unchanged). Proposer params follow the drafter's
    heads when the proposer has a DrafterConfig, else the target's (the MTP head is a target layer)."""
    if mesh is None:
        return params
    target, draft = layouts(mesh, cfg, proposer)
    tparams, pparams = params
    return (jax.device_put(tparams, param_shardings(tparams, target)),
            jax.device_put(pparams, param_shardings(pparams, draft or target)))


def pin_state(state, batch: int, mesh: Mesh | None, cfg: TargetConfig, proposer=None):
    """Inside the loop's jitted phases: a loop state (or a proposer's state) of ``batch`` rows constrained
    to ``state_shardings`` (no-op without a mesh), so the caches keep one layout across steps and phases
    and the partitioner never gathers them (left alone, it lays out replicated KV heads like the
    head-sharded queries, then gathers the cache back)."""
    if mesh is None:
        return state
    target, draft = layouts(mesh, cfg, proposer)
    return constrain_state(state, batch, target, draft)


def traced_mesh():
    """The mesh a loop phase traces under (``mesh_context``: JAX's abstract mesh), or None outside one and
    inside a ``shard_map`` body (its axes are manual there: the code sees one device's shard)."""
    mesh = jax.sharding.get_abstract_mesh()
    if not set(AXES) <= set(mesh.axis_names) or AxisType.Manual in mesh.axis_types:
        return None
    return mesh


def constrain_cache(cache, cfg: TargetConfig | DrafterConfig):
    """Inside a phase traced on a mesh: a ``CACHES`` pytree (e.g. an ``AttentionCache``) held in its table's
    layout for ``cfg``'s heads (no-op outside one). For a cache written and read inside one phase, e.g. in a
    scan's carry, where the loop's pins cannot reach: left alone, the partitioner splits replicated KV heads
    like the head-sharded queries that read them, and the next pin gathers them back."""
    mesh = traced_mesh()
    if mesh is None:
        return cache
    layout, fields = Layout.of(cfg, mesh), CACHES[type(cache).__name__]
    return dataclasses.replace(cache, **{
        name: jax.lax.with_sharding_constraint(getattr(cache, name), NamedSharding(
            mesh, layout.spec(axes, getattr(cache, name).shape))) for name, axes in fields.items()})


def per_head(fn, args: tuple, labels: tuple, out_labels, *, heads: tuple[str, int], shared: tuple[str, int]):
    """``fn(*args)``, run per device in ``shard_map`` when traced under a loop's mesh (else directly).

    The kernels here are independent per row and per head, so each device runs them on its own shard:
    rows over the mesh's batch axis, heads over the model axis, as ``RULES`` lays them out.
    ``labels`` name each argument's dimensions (``out_labels`` the output's, a tuple of them for several
    outputs): "B" rows, "N" the heads the output follows (query heads, GDN value heads), "K" the shared
    heads each serving N / K consecutive N heads (KV heads, GDN key heads), None anything else.
    ``heads``/``shared`` are (logical axis, count). When the model axis divides N but not K (e.g. 2 KV
    heads on 8 devices: replicated by the table), each device's N heads read one K head, which it slices
    out of its full copy; when it divides neither, heads stay whole on every device (rows still split, or not).
    """
    mesh = traced_mesh()
    if mesh is None:
        return fn(*args)
    (n_name, n), (k_name, k) = heads, shared
    layout = Layout(mesh, {n_name: n, k_name: k})
    batch = args[[i for i, lab in enumerate(labels) if "B" in lab][0]].shape[0]
    rows, axis, kv_axis = layout.mesh_axis("batch", batch), layout.mesh_axis(n_name), layout.mesh_axis(k_name)
    size = 1 if axis is None else mesh_size(mesh, axis)
    if axis is not None and kv_axis is None and size % k:
        axis = None  # a device's heads would straddle two shared heads
    spec = {"B": rows, "N": axis, "K": kv_axis}
    to_spec = lambda lab: P(*(spec.get(d) for d in lab))  # noqa: E731
    # Splitting neither rows nor heads, it still runs in shard_map (every device the whole call on replicated
    # inputs): a Mosaic kernel cannot be partitioned automatically, e.g. 16 heads on a model axis of 6.

    def body(*local):
        if axis is not None and kv_axis is None:  # this device's N heads all read shared head i * K / size
            first = jax.lax.axis_index(axis) * k // size
            local = [jax.lax.dynamic_slice_in_dim(x, first, 1, lab.index("K")) if "K" in lab else x
                     for x, lab in zip(local, labels, strict=True)]
        return fn(*local)

    outs = to_spec(out_labels) if isinstance(out_labels[0], str | None) else tuple(map(to_spec, out_labels))
    return jax.shard_map(body, mesh=mesh, in_specs=tuple(map(to_spec, labels)), out_specs=outs,
                         check_vma=False)(*args)


def over_experts(routed, x: jax.Array, experts, router) -> jax.Array:
    """The routed-expert part of an MoE layer, expert-parallel when traced under a loop's mesh.

    ``routed(x [M, D], experts, router, first) -> [M, D]`` must sum, per token, the contributions of
    the experts the ``experts`` module holds (global ids ``first`` .. ``first + E_l - 1``; tokens routed
    elsewhere add nothing); ``router`` (a module) scores all E. Without a mesh in context
    (``mesh_context``), or when the expert axes do not divide E, it runs once over every expert
    (first = 0). On a mesh it runs in ``shard_map``: each device holds E / (model x expert) experts
    (``RULES["experts"]``), the whole router and the rows of its data shard; it routes them all,
    applies its own experts, and one ``psum`` over the expert axes adds the parts (the psum scheme of
    JAX's LLM examples: no token exchange, one all-reduce of [M, D] per layer, the cheaper choice at
    decode's few tokens per step).
    """
    mesh = traced_mesh()
    num = jax.tree.leaves(nnx.state(experts))[0].shape[0]
    axis = None if mesh is None else Layout(mesh, {"experts": num}).mesh_axis("experts")
    if axis is None:
        return routed(x, experts, router, 0)
    (egraph, estate), (rgraph, rstate) = nnx.split(experts), nnx.split(router)
    local = num // mesh_size(mesh, axis)
    rows = Layout(mesh, {}).mesh_axis("batch", x.shape[0])

    def body(x, estate, rstate):
        first = jax.lax.axis_index(axis) * local
        return jax.lax.psum(routed(x, nnx.merge(egraph, estate), nnx.merge(rgraph, rstate), first), axis)

    specs = (P(rows), jax.tree.map(lambda _: P(axis), estate), jax.tree.map(lambda _: P(), rstate))
    # check_vma off: a Pallas kernel inside (dflash_jax/kernels/moe.py) declares no per-axis variance of its output
    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(rows), check_vma=False)(x, estate, rstate)


def mesh_context(mesh: Mesh | None):
    """The context a loop phase traces in: ``mesh`` as JAX's abstract mesh (read by ``over_experts``);
    nothing without one."""
    return contextlib.nullcontext() if mesh is None else jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def host(tree):
    """Numpy copies of a pytree of arrays, whole even when their rows are spread over processes
    (``multihost_utils.process_allgather``); every process must call it."""
    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.array(x)
    return jax.tree.map(one, tree)


def batch_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """Rows over the data axis (replicated when it does not divide them): prompts [B, P], lengths [B]."""
    return Layout(mesh, {}).sharding(("batch",) + (None,) * (len(shape) - 1), shape)


def shard_rows(mesh: Mesh, *arrays):
    """Host arrays with leading batch dimension placed with ``batch_sharding``."""
    return tuple(place(np.asarray(a), batch_sharding(mesh, np.shape(a))) for a in arrays)


# ----------------------------------------------------------------------------------- processes


def is_writer() -> bool:
    """Whether this process writes files and prints (process 0 of a multi-process run, or the only one)."""
    return jax.process_index() == 0
