"""Reference outputs from transformers' own Qwen3.5 modules (the oracle for target tests)."""

from __future__ import annotations

import numpy as np
import pytest

# Importing this module skips the test module that does, where torch is missing.
torch = pytest.importorskip("torch", reason="the transformers oracle needs torch")


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens))).logits.numpy()


def hf_hidden_states(model, tokens: np.ndarray) -> tuple[np.ndarray, ...]:
    with torch.no_grad():
        out = model(torch.tensor(np.asarray(tokens)), output_hidden_states=True)
    return tuple(h.numpy() for h in out.hidden_states)


def tiny_drafter_config(target_cfg):
    """A one-layer z-lab drafter (block 4) for a tiny target, tapping layers 0 and 2 (HF hidden_states[1], [3])."""
    from dflash_jax.config import DrafterConfig

    return DrafterConfig(hidden_size=target_cfg.hidden_size, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=48, rms_norm_eps=1e-6,
                         rope_theta=10000.0, vocab_size=target_cfg.vocab_size, block_size=4,
                         mask_token_id=target_cfg.vocab_size - 1, target_layer_ids=(0, 2),
                         num_target_layers=target_cfg.num_hidden_layers, layer_types=("full_attention",),
                         sliding_window=None, is_causal=None, target_hidden_size=target_cfg.hidden_size)
