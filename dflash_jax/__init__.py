"""dflash_jax: DFlash speculative decoding (block-diffusion drafter + KV injection) for Qwen3.5 in JAX/Flax.

The names users and notebooks rely on are re-exported here; see README.md for a tour. They are loaded on first
use (PEP 562), so that importing a submodule that needs no JAX (the command line's parser, ``frontend``) stays
quick: ``dflash-jax --help`` does not start JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# public name -> the module that defines it
_EXPORTS = {
    "generate": "dflash_jax.decoding.api", "make_generate": "dflash_jax.decoding.api",
    "stream": "dflash_jax.decoding.api", "prefill_prefix": "dflash_jax.decoding.api",
    "PromptPrefix": "dflash_jax.decoding.api",
    "FinishReason": "dflash_jax.decoding.loop", "GenerateOutput": "dflash_jax.decoding.loop",
    "SpecConfig": "dflash_jax.decoding.loop",
    "SamplingConfig": "dflash_jax.decoding.sampling",
    "Drafter": "dflash_jax.models.drafter", "load_drafter": "dflash_jax.models.drafter",
    "Target": "dflash_jax.models.target", "load_target": "dflash_jax.models.target",
}

__all__ = [
    "Drafter", "FinishReason", "GenerateOutput", "PromptPrefix", "SamplingConfig", "SpecConfig", "Target", "generate",
    "load_drafter", "load_target", "make_generate", "prefill_prefix", "stream",
]

if TYPE_CHECKING:
    from dflash_jax.decoding.api import PromptPrefix, generate, make_generate, prefill_prefix, stream
    from dflash_jax.decoding.loop import FinishReason, GenerateOutput, SpecConfig
    from dflash_jax.decoding.sampling import SamplingConfig
    from dflash_jax.models.drafter import Drafter, load_drafter
    from dflash_jax.models.target import Target, load_target


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dflash_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # once: later lookups find it here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
