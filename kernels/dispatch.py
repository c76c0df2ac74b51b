"""Kernel modes: a Pallas kernel or its plain-jnp reference, chosen by static configuration.

Modes: ``"reference"`` (jnp, the oracle and the CPU/TPU path), ``"pallas"`` (the Triton-backend
kernel, for ROCm and CUDA) and ``"interpret"`` (the Pallas kernel run by the Pallas interpreter, for
checking numerics on a CPU). Each op takes ``impl=`` (a mode, or None for ``default_mode()``). The
models carry their mode as a static attribute of every kernel-calling layer (``kernels``), so it is
part of the graph that jitted functions take as a static argument: a different mode is a different
jit cache entry, and nothing has to be retraced by hand or cleared. ``DFLASH_KERNELS`` only sets the
default a model gets when it is built without an explicit mode.

On a device mesh a Pallas kernel is a custom call XLA's partitioner cannot split (it would gather
the operands and run the whole kernel on every device); ``per_head`` runs it in ``shard_map`` on
each device's rows and heads instead, with the layout of ``dflash_jax.sharding``'s table.
"""

from __future__ import annotations

import os

import jax
from jax.sharding import PartitionSpec as P

from dflash_jax import sharding

MODES = ("reference", "pallas", "interpret")


def check(mode: str, source: str = "kernels") -> str:
    """``mode`` if it is one of ``MODES``, else a ValueError naming where it came from."""
    if mode not in MODES:
        raise ValueError(f"{source}: unknown kernel mode {mode!r}; expected one of {MODES}")
    return mode


def default_mode() -> str:
    """``DFLASH_KERNELS`` when set, else ``pallas`` on a GPU backend and ``reference`` elsewhere."""
    env = os.environ.get("DFLASH_KERNELS")
    if env:
        return check(env, "DFLASH_KERNELS")
    return "pallas" if jax.default_backend() in ("gpu", "cuda", "rocm") else "reference"


def resolve(impl: str | None = None) -> str:
    """The mode an op runs in: ``impl`` when given, else ``default_mode()``."""
    return default_mode() if impl is None else check(impl, "impl")


def per_head(fn, args: tuple, labels: tuple, out_labels, *, heads: tuple[str, int], shared: tuple[str, int]):
    """``fn(*args)``, run per device in ``shard_map`` when traced under a loop's mesh (else directly).

    The kernels here are independent per row and per head, so each device runs them on its own shard:
    rows over the mesh's batch axis, heads over the model axis, as ``sharding.RULES`` lays them out.
    ``labels`` name each argument's dimensions (``out_labels`` the output's, a tuple of them for several
    outputs): "B" rows, "N" the heads the output follows (query heads, GDN value heads), "K" the shared
    heads each serving N / K consecutive N heads (KV heads, GDN key heads), None anything else.
    ``heads``/``shared`` are (logical axis, count). When the model axis divides N but not K (e.g. 2 KV
    heads on 8 devices: replicated by the table), each device's N heads read one K head, which it slices
    out of its full copy; when it divides neither, heads stay whole on every device (rows still split).
    """
    mesh = sharding.traced_mesh()
    if mesh is None:
        return fn(*args)
    (n_name, n), (k_name, k) = heads, shared
    layout = sharding.Layout(mesh, {n_name: n, k_name: k})
    batch = args[[i for i, lab in enumerate(labels) if "B" in lab][0]].shape[0]
    rows, axis, kv_axis = layout.mesh_axis("batch", batch), layout.mesh_axis(n_name), layout.mesh_axis(k_name)
    size = 1 if axis is None else sharding.mesh_size(mesh, axis)
    if axis is not None and kv_axis is None and size % k:
        axis = None  # a device's heads would straddle two shared heads
    spec = {"B": rows, "N": axis, "K": kv_axis}
    to_spec = lambda lab: P(*(spec.get(d) for d in lab))  # noqa: E731
    if rows is None and axis is None:
        return fn(*args)

    def body(*local):
        if axis is not None and kv_axis is None:  # this device's N heads all read shared head i * K / size
            first = jax.lax.axis_index(axis) * k // size
            local = [jax.lax.dynamic_slice_in_dim(x, first, 1, lab.index("K")) if "K" in lab else x
                     for x, lab in zip(local, labels, strict=True)]
        return fn(*local)

    outs = to_spec(out_labels) if isinstance(out_labels[0], str | None) else tuple(map(to_spec, out_labels))
    return jax.shard_map(body, mesh=mesh, in_specs=tuple(map(to_spec, labels)), out_specs=outs,
                         check_vma=False)(*args)
