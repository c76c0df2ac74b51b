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
