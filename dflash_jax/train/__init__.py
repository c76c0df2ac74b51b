"""Training: tokenizer, the small Qwen3.5 target, the DFlash drafter and the MTP head (optax).

Sits beside the inference stack and uses it: ``target.forward`` for the LM and the frozen target,
the drafter's modules for its training forward, ``generate`` for the target-regenerated data.
``ship.py`` reproduces the models shipped under ``dflash_jax/assets``.
"""
