"""Kernel modes: a Pallas kernel or its plain-jnp reference, chosen by static configuration.

Modes: ``"reference"`` (jnp, the oracle and the CPU path), ``"pallas"`` (the Triton-backend kernels, for ROCm
and CUDA), ``"interpret"`` (those kernels run by the Pallas interpreter, for checking numerics on a CPU),
``"tpu"`` (the TPU forms: Pallas TPU (Mosaic) kernels where an op has one, ``attention_tpu.py``,
``moe.grouped_matmul_tpu`` and ``gdn.gdn_verify``'s ``gdn_tpu.py``, the XLA reference for the rest)
and ``"tpu-interpret"`` (the same, the Mosaic kernels interpreted on a CPU). ``"auto"`` (or None) is
``default_mode()``: the platform's kernels.

Each op takes ``impl=`` (a mode, or None for ``default_mode()``). The models carry their mode as a static
attribute of every kernel-calling layer (``kernels``), so it is part of the graph that jitted functions take
as a static argument: a different mode is a different jit cache entry, and nothing has to be retraced by hand
or cleared. ``DFLASH_KERNELS`` only sets the default a model gets when it is built without an explicit mode.
The ops written for the Triton backend know nothing of the TPU modes: the layers that choose a TPU form
(``models/layers.py``) call the others inside ``generic()``, where a TPU mode resolves to ``"reference"``.
On a device mesh a Pallas kernel is a custom call XLA's partitioner cannot split; the models run it per
device (``dflash_jax.parallel.per_head``), so nothing here knows about meshes.
"""

from __future__ import annotations

import contextlib
import contextvars
import os

import jax

MODES = ("reference", "pallas", "interpret", "tpu", "tpu-interpret")
TPU_MODES = ("tpu", "tpu-interpret")
_GENERIC = contextvars.ContextVar("dflash_kernels_generic", default=False)


def check(mode: str, source: str = "kernels") -> str:
    """``mode`` if it is one of ``MODES`` (``"auto"``: ``default_mode()``), else a ValueError naming where it
    came from."""
    if mode == "auto":
        return default_mode()
    if mode not in MODES:
        raise ValueError(f"{source}: unknown kernel mode {mode!r}; expected one of {MODES} or 'auto'")
    return mode


def default_mode() -> str:
    """``DFLASH_KERNELS`` when set, else ``pallas`` on a GPU backend, ``tpu`` on a TPU and ``reference``
    elsewhere."""
    env = os.environ.get("DFLASH_KERNELS")
    if env and env != "auto":
        return check(env, "DFLASH_KERNELS")
    backend = jax.default_backend()
    return "pallas" if backend in ("gpu", "cuda", "rocm") else "tpu" if backend == "tpu" else "reference"


def resolve(impl: str | None = None) -> str:
    """The mode an op runs in: ``impl`` when given, else ``default_mode()``; inside ``generic()`` a TPU mode
    is ``"reference"`` (the op has no TPU form)."""
    mode = default_mode() if impl is None else check(impl, "impl")
    return "reference" if mode in TPU_MODES and _GENERIC.get() else mode


def is_tpu(mode: str | None) -> bool:
    """Whether ``mode`` (None: the default) picks the TPU forms."""
    return (default_mode() if mode is None else check(mode)) in TPU_MODES


@contextlib.contextmanager
def generic():
    """Ops traced inside run their XLA reference where a TPU mode was asked for (they have no TPU form)."""
    token = _GENERIC.set(True)
    try:
        yield
    finally:
        _GENERIC.reset(token)
