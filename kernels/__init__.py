"""Hot-path kernels of dflash_jax, imported as ``dflash_jax.kernels``.

Each op has a plain-jnp reference (the oracle, and the CPU/TPU path) and a Pallas kernel on the
Triton backend (ROCm gfx950 and CUDA); ``dispatch`` picks one at trace time.
"""

from dflash_jax.kernels.attention import attention, attention_reference
from dflash_jax.kernels.dispatch import resolve, use
from dflash_jax.kernels.gdn import (
    gdn_chunked,
    gdn_chunked_reference,
    gdn_recurrent_reference,
    gdn_replay,
    gdn_replay_reference,
    gdn_verify,
    gdn_verify_reference,
)
from dflash_jax.kernels.moe import grouped_matmul, grouped_matmul_reference

__all__ = [
    "attention", "attention_reference", "gdn_chunked", "gdn_chunked_reference", "gdn_recurrent_reference",
    "gdn_replay", "gdn_replay_reference", "gdn_verify", "gdn_verify_reference", "grouped_matmul",
    "grouped_matmul_reference", "resolve", "use",
]
