"""dflash_jax: DFlash speculative decoding (block-diffusion drafter + KV injection) for Qwen3.5 in JAX/Flax.

The names users and notebooks rely on are re-exported here; see README.md for a tour.
"""

from dflash_jax.decoding.api import generate, make_generate, stream
from dflash_jax.decoding.loop import FinishReason, GenerateOutput, SpecConfig
from dflash_jax.decoding.sampling import SamplingConfig
from dflash_jax.models.drafter import Drafter, load_drafter
from dflash_jax.models.target import Target, load_target

__all__ = [
    "Drafter", "FinishReason", "GenerateOutput", "SamplingConfig", "SpecConfig", "Target", "generate", "load_drafter",
    "load_target",
    "make_generate", "stream",
]
