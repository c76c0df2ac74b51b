"""Pieces shared by the Pallas kernels: Triton compiler parameters and the report/bench case type."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jax.experimental.pallas import triton as pltriton


def triton_params(num_warps: int = 4, num_stages: int = 1) -> pltriton.CompilerParams:
    """Explicit Triton-backend parameters: without them jax 0.10.2 picks Mosaic GPU, which has no ROCm.

    On gfx950 a warp is a 64-lane wavefront, so num_warps <= 16.
    """
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


@dataclasses.dataclass(frozen=True)
class KernelCase:
    """One kernel at one shape and block configuration, for the compile report and the GPU bench.

    ``fn(*args)`` runs the Pallas kernel (mode "pallas"); ``reference(*args)`` its jnp reference.
    ``args`` are ``jax.ShapeDtypeStruct``s (the bench fills them with data). ``bytes_moved`` is the
    minimum HBM traffic of one call, for achieved-bandwidth figures.
    """

    name: str
    fn: Callable[..., Any]
    reference: Callable[..., Any]
    args: tuple[Any, ...]
    bytes_moved: int = 0
