"""Kernel modes: a Pallas kernel or its plain-jnp reference, chosen by static configuration.

Modes: ``"reference"`` (jnp, the oracle and the CPU/TPU path), ``"pallas"`` (the Triton-backend
kernel, for ROCm and CUDA) and ``"interpret"`` (the Pallas kernel run by the Pallas interpreter, for
checking numerics on a CPU). Each op takes ``impl=`` (a mode, or None for ``default_mode()``). The
models carry their mode as a static attribute of every kernel-calling layer (``kernels``), so it is
part of the graph that jitted functions take as a static argument: a different mode is a different
jit cache entry, and nothing has to be retraced by hand or cleared. ``DFLASH_KERNELS`` only sets the
default a model gets when it is built without an explicit mode.
On a device mesh a Pallas kernel is a custom call XLA's partitioner cannot split; the models run it per
device (``dflash_jax.parallel.per_head``), so nothing here knows about meshes.
"""

from __future__ import annotations

import os

import jax

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
