"""Grouped (per-expert) matmul for the MoE layers: token rows sorted by expert times expert weights.

Expert weights keep the checkpoint's [E, out, in] layout (no transpose at load time).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.kernels import dispatch

_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def grouped_matmul_reference(x, w, group_sizes):
    """Rows of x grouped by expert, each group times its expert's weight.

    Args:
      x: [M, Din], rows sorted by expert; group_sizes: [E] int32 rows per expert (sum <= M; rows
        past the sum give zeros).
      w: [E, Dout, Din].
    Returns:
      [M, Dout] in x's dtype, accumulated in f32.
    """
    out = jax.lax.ragged_dot_general(x, w, group_sizes, _DIMS, preferred_element_type=jnp.float32)
    return out.astype(x.dtype)


def grouped_matmul(x, w, group_sizes, *, impl=None):
    mode = dispatch.resolve(impl)
    if mode == "reference":
        return grouped_matmul_reference(x, w, group_sizes)
    raise NotImplementedError(f"grouped_matmul: no Pallas kernel yet (mode {mode!r})")
