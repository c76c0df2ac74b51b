"""Where every array lives on a device mesh: one table of logical axes, mapped onto mesh axes.

Sits beside the parameter trees (``target.py``, ``drafter.py``) and under the loop: loading places
each tensor on its shards with ``param_shardings``, and the loop pins its state (caches, proposer
state, per-row arrays) with ``constrain_state``; inside jit, XLA's SPMD partitioner (GSPMD) splits
the computation to match. Nothing here is specific to one device count: a 1x1x1 mesh is the
single-device case.

The mesh has three axes (``AXES``): ``data`` splits batch rows (data parallel), ``model`` splits
heads, MLP width and vocabulary (tensor parallel, Megatron style: column-parallel in-projections,
row-parallel out-projections, so each layer costs one all-reduce of its [B, T, D] output), and
``expert`` splits the routed experts. Logical axes (``RULES``) name what a tensor dimension is;
``PARAMS`` and ``CACHES`` give every parameter and cache field its logical axes, once.

A logical axis is sharded only when the mesh axis divides its unit count (heads, not head x
head_dim channels), else it is replicated and ``Layout.replicated`` says so. For Qwen3.5-27B at
TP=8: 24 query heads, 48 GDN value heads and 16 GDN key heads shard; its 4 KV heads do not, so
k_proj/v_proj and the attention K/V caches are replicated on every model shard.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

if TYPE_CHECKING:
    from dflash_jax.config import TargetConfig
    from dflash_jax.drafter import DrafterConfig

AXES = ("data", "model", "expert")

# Logical axis -> mesh axis. Logical names not listed (the residual width D, head_dim, the cache
# length S, the GDN conv channels) are never sharded.
RULES: dict[str, str] = {
    "batch": "data",  # rows of a batch: prompts, caches, loop state
    "vocab": "model",  # embedding rows and LM head rows (vocab-parallel)
    "heads": "model",  # attention query heads N (q_proj rows with their gates, o_proj columns)
    "kv_heads": "model",  # attention KV heads K (k/v_proj rows, the K/V caches)
    "v_heads": "model",  # GDN value heads Hv (z/a/b projections, decay, out_proj, the state [B, Hv, Dk, Dv])
    "k_heads": "model",  # GDN key heads Hk (the L2-normalised keys kept pending by a verify)
    "mlp": "model",  # MLP width F (dense MLP, shared expert, drafter MLP)
    "experts": "expert",  # routed experts E
}

# Parameter path (dots, as in the HF checkpoint; weights [out, in]) -> logical axes per dimension.
# First full match wins; unmatched parameters are replicated: norms, the MoE router, the drafter's fc
# and the MTP fc, and the GDN in_proj_qkv / conv1d, whose channels concatenate q | k | v (a shard
# of those rows would not hold whole heads).
PARAMS: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"(.*\.)?embed_tokens\.weight", ("vocab", None)),
    (r"lm_head\.weight", ("vocab", None)),
    (r".*self_attn\.q_proj\.weight", ("heads", None)),
    (r".*self_attn\.[kv]_proj\.weight", ("kv_heads", None)),
    (r".*self_attn\.o_proj\.weight", (None, "heads")),
    (r".*linear_attn\.in_proj_[zab]\.weight", ("v_heads", None)),
    (r".*linear_attn\.(A_log|dt_bias)", ("v_heads",)),
    (r".*linear_attn\.out_proj\.weight", (None, "v_heads")),
    (r".*(mlp|shared_expert)\.(gate|up)_proj\.weight", ("mlp", None)),
    (r".*(mlp|shared_expert)\.down_proj\.weight", (None, "mlp")),
    (r".*experts\.(gate_up|down)_proj", ("experts", None, None)),  # [E, 2I, D] / [E, D, I]
)

# Cache pytree class -> {field: logical axes}. Keyed by class name (cache.py's, the drafter's DraftCache,
# mtp.py's MTPState) so that this module sits below every model module in the import graph. Fields not
# listed hold per-row values and follow the default rule of ``state_shardings``.
CACHES: dict[str, dict[str, tuple[str | None, ...]]] = {
    "AttentionCache": {"k": ("batch", None, "kv_heads", None), "v": ("batch", None, "kv_heads", None)},
    "GDNCache": {"conv": ("batch", None, None), "state": ("batch", "v_heads", None, None)},
    "GDNPending": {"mixed": ("batch", None, None), "k": ("batch", None, "k_heads", None),
                   "v": ("batch", None, "v_heads", None), "g": ("batch", None, "v_heads"),
                   "beta": ("batch", None, "v_heads")},
    "MTPState": {"k": ("batch", None, "kv_heads", None), "v": ("batch", None, "kv_heads", None)},
    "DraftCache": {"k": ("batch", None, "kv_heads", None), "v": ("batch", None, "kv_heads", None)},
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
        counts |= {"v_heads": cfg.linear_num_value_heads, "k_heads": cfg.linear_num_key_heads}
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

    def mesh_axis(self, logical: str | None, dim: int | None = None) -> str | None:
        """The mesh axis for a logical axis, or None (replicated) when the mesh axis does not divide it."""
        axis = RULES.get(logical)
        if axis is None:
            return None
        size = self.mesh.shape[axis]
        units = self.counts.get(logical, dim)
        if size == 1 or (units is not None and units % size) or (dim is not None and dim % size):
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
            axis = RULES[name]
            size = self.mesh.shape[axis]
            if size > 1 and units % size:
                out.append(f"{name} ({units}) replicated: not divisible by the {axis} axis ({size})")
        return out


def param_axes(path: str, ndim: int) -> tuple[str | None, ...]:
    """Logical axes of the parameter at a dotted path (replicated when no rule matches)."""
    for pattern, axes in PARAMS:
        if re.fullmatch(pattern, path):
            if len(axes) != ndim:
                raise ValueError(f"sharding rule {pattern!r} gives {len(axes)} axes to {path!r} of rank {ndim}")
            return axes
    return (None,) * ndim


def _dotted(path) -> str:
    """'model.layers.0.mlp.up_proj.weight' from a pytree key path (an NNX Variable's own ``.value`` dropped)."""
    if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
        path = path[:-1]
    return ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def param_shardings(params, layout: Layout):
    """A pytree of NamedShardings matching ``params`` (an ``nnx.State``, arrays or ShapeDtypeStructs)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: layout.sharding(param_axes(_dotted(path), x.ndim), x.shape), params)


def place(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """Puts a host array onto its shards: each device receives only its own slice (every process
    calls this with the same array and fills just its addressable devices)."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def loader(mesh: Mesh, cfg: TargetConfig | DrafterConfig):
    """The ``place`` callback of ``checkpoint.load_state``: each tensor, by its key, straight onto its shards."""
    layout = Layout.of(cfg, mesh)
    return lambda key, host: place(host, layout.sharding(param_axes(key, host.ndim), host.shape))


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
            if f.name in fields:
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


def shard_params(params, mesh: Mesh, cfg: TargetConfig, proposer=None):
    """Places loop params ``(target params, proposer params)`` on ``mesh`` by ``PARAMS`` (already placed
    leaves move only if their sharding differs). Proposer params follow the drafter's heads when the
    proposer has a DrafterConfig, else the target's (the MTP head is a target layer)."""
    target, draft = layouts(mesh, cfg, proposer)
    tparams, pparams = params
    return (jax.device_put(tparams, param_shardings(tparams, target)),
            jax.device_put(pparams, param_shardings(pparams, draft or target)))


def pin_state(state, mesh: Mesh | None, cfg: TargetConfig, proposer=None):
    """Inside the loop's jitted phases: the loop state constrained to ``state_shardings`` (no-op without a
    mesh), so the caches keep one layout across steps and the partitioner never gathers them."""
    if mesh is None:
        return state
    target, draft = layouts(mesh, cfg, proposer)
    return constrain_state(state, state.anchor.shape[0], target, draft)


def batch_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """Rows over the data axis (replicated when it does not divide them): prompts [B, P], lengths [B]."""
    return Layout(mesh, {}).sharding(("batch",) + (None,) * (len(shape) - 1), shape)


def shard_rows(mesh: Mesh, *arrays):
    """Host arrays with leading batch dimension placed with ``batch_sharding``."""
    return tuple(place(np.asarray(a), batch_sharding(mesh, np.shape(a))) for a in arrays)


_COLLECTIVE = re.compile(r"^\s*(?:ROOT )?%(?P<name>\S+) = (?P<type>\(.*?\)|\S+) "
                         r"(?P<op>all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
          "f64": 8, "s64": 8, "u64": 8}


def collectives(hlo: str) -> list[dict]:
    """The collectives in a compiled program's HLO text (``jit(f).lower(...).compile().as_text()``).

    Each: ``op``, result ``shapes`` (per device), result ``bytes`` per device and the JAX op ``name`` it
    came from. Counted as written: one inside a loop body appears once.
    """
    out = []
    for line in hlo.splitlines():
        m = _COLLECTIVE.match(line)
        if not m:
            continue
        arrays = [(t, tuple(int(d) for d in dims.split(",") if d)) for t, dims in _ARRAY.findall(m["type"])]
        name = re.search(r'op_name="([^"]*)"', line)
        out.append({"op": m["op"], "shapes": [shape for _, shape in arrays],
                    "bytes": sum(_BYTES.get(t, 4) * int(np.prod(shape)) for t, shape in arrays),
                    "name": name[1] if name else m["name"]})
    return out
