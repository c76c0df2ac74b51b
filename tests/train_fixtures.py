"""A tiny random target shared by the training tests (tests/train/test_train_*.py)."""

from __future__ import annotations

from dflash_jax.models.target import init_target
from dflash_jax.train import lm


def tiny_target(seed=0):
    cfg = lm.small_config(vocab_size=64, eos_id=0, hidden=32, layers=4, intermediate=64, heads=2, kv_heads=1,
                          head_dim=16, linear_key_heads=1, linear_value_heads=2, linear_head_dim=16)
    return init_target(cfg, seed=seed)
