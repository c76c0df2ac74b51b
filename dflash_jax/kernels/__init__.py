"""Hot-path kernels of dflash_jax, imported as ``dflash_jax.kernels``.

Each op has a plain-jnp reference (the oracle, and the CPU/TPU path) and a Pallas kernel on the
Triton backend (ROCm gfx950 and CUDA); each op's ``impl=`` mode picks one (``"interpret"`` runs the
kernels through the Pallas interpreter, to check them on a CPU). Models carry the mode statically
(``dispatch``).
"""

from dflash_jax.kernels.attention import (
    AttentionBlocks,
    attention,
    attention_pallas,
    attention_reference,
    cache_shapes,
    empty_cache,
    write_cache,
)
from dflash_jax.kernels.dispatch import MODES, default_mode, resolve
from dflash_jax.kernels.gdn import (
    ChunkedBlocks,
    RecurrentBlocks,
    gdn_chunked,
    gdn_chunked_pallas,
    gdn_chunked_reference,
    gdn_recurrent_reference,
    gdn_replay,
    gdn_replay_pallas,
    gdn_replay_reference,
    gdn_verify,
    gdn_verify_pallas,
    gdn_verify_reference,
)
from dflash_jax.kernels.moe import GroupedBlocks, grouped_matmul, grouped_matmul_pallas, grouped_matmul_reference
from dflash_jax.kernels.mxfp4 import (
    Mxfp4Blocks,
    dequantize_mxfp4,
    mxfp4_matmul,
    mxfp4_matmul_reference,
    quantize_mxfp4,
)

__all__ = [
    "MODES", "AttentionBlocks", "ChunkedBlocks", "GroupedBlocks", "Mxfp4Blocks", "RecurrentBlocks", "attention",
    "attention_pallas", "attention_reference", "cache_shapes", "default_mode", "dequantize_mxfp4", "empty_cache",
    "gdn_chunked", "gdn_chunked_pallas", "gdn_chunked_reference", "gdn_recurrent_reference", "gdn_replay",
    "gdn_replay_pallas", "gdn_replay_reference", "gdn_verify", "gdn_verify_pallas", "gdn_verify_reference",
    "grouped_matmul", "grouped_matmul_pallas", "grouped_matmul_reference", "mxfp4_matmul", "mxfp4_matmul_reference",
    "quantize_mxfp4", "resolve", "write_cache",
]
