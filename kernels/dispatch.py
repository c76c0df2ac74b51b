"""Chooses, at trace time, between a Pallas kernel and its plain-jnp reference.

Modes: ``"reference"`` (jnp, the oracle and the CPU/TPU path), ``"pallas"`` (the Triton-backend
kernel, for ROCm and CUDA) and ``"interpret"`` (the Pallas kernel run by the Pallas interpreter, for
checking numerics on a CPU). The default is ``pallas`` on a GPU backend and ``reference`` elsewhere;
the ``DFLASH_KERNELS`` environment variable, the ``use(...)`` context manager and each op's ``impl=``
argument override it, in increasing priority.
"""

from __future__ import annotations

import contextlib
import os
import threading

import jax

MODES = ("reference", "pallas", "interpret")
_local = threading.local()


def _check(mode: str, source: str) -> str:
    if mode not in MODES:
        raise ValueError(f"{source}: unknown kernel mode {mode!r}; expected one of {MODES}")
    return mode


def resolve(impl: str | None = None) -> str:
    """The mode an op traced now should use."""
    if impl is not None:
        return _check(impl, "impl")
    mode = getattr(_local, "mode", None)
    if mode is not None:
        return mode
    env = os.environ.get("DFLASH_KERNELS")
    if env:
        return _check(env, "DFLASH_KERNELS")
    return "pallas" if jax.default_backend() in ("gpu", "cuda", "rocm") else "reference"


@contextlib.contextmanager
def use(mode: str):
    """Traces every kernel op inside the block with ``mode`` (e.g. ``"interpret"`` in tests).

    The mode is read at trace time, which jit's cache does not see, so entering and leaving the
    block clears JAX's caches: jitted functions retrace with the mode in force.
    """
    previous = getattr(_local, "mode", None)
    _local.mode = _check(mode, "use()")
    jax.clear_caches()
    try:
        yield
    finally:
        _local.mode = previous
        jax.clear_caches()
