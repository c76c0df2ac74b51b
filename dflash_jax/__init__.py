"""dflash_jax: DFlash speculative decoding for Qwen3.5 in JAX/Flax."""
