"""Pretraining the small Qwen3.5-architecture target (hybrid Gated DeltaNet + gated attention, 3:1).

Sits on ``loop.py`` and ``target.forward`` (the differentiable full-sequence forward used by
inference too, so the trained weights are exactly what ``load_target`` runs). ``save_target`` writes
the Hugging Face layout (``Qwen3_5ForCausalLM``, ``qwen3_5_text``) that both ``load_target`` and
``transformers.AutoModelForCausalLM`` read.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dflash_jax.config import TargetConfig
from dflash_jax.io import atomic, checkpoint
from dflash_jax.models.layers import hf_tensors
from dflash_jax.models.target import GDN_LAYOUT, Target, forward, init_target
from dflash_jax.train import loop


def small_config(*, vocab_size: int, eos_id: int, hidden: int = 256, layers: int = 4, intermediate: int = 768,
                 heads: int = 4, kv_heads: int = 2, head_dim: int = 64, linear_key_heads: int = 2,
                 linear_value_heads: int = 4, linear_head_dim: int = 64, mtp_layers: int = 1) -> TargetConfig:
    """A small dense Qwen3.5 text config: every 4th layer is gated attention, the others Gated DeltaNet."""
    return TargetConfig(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
        layer_types=tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)),
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        linear_num_key_heads=linear_key_heads, linear_num_value_heads=linear_value_heads,
        linear_key_head_dim=linear_head_dim, linear_value_head_dim=linear_head_dim,
        intermediate_size=intermediate, tie_word_embeddings=True, mtp_num_hidden_layers=mtp_layers,
        eos_token_ids=(eos_id,), max_position_embeddings=4096)


def hf_config(cfg: TargetConfig) -> dict:
    """The flat ``Qwen3_5ForCausalLM`` config.json of a dense target (``TargetConfig.from_hf`` reads it back)."""
    if cfg.is_moe:
        raise ValueError("hf_config writes dense targets only")
    return {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "hidden_act": "silu",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "layer_types": list(cfg.layer_types),
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "attention_bias": False, "attention_dropout": 0.0,
        "rope_parameters": {**cfg.rope_scaling.to_hf(), "rope_theta": cfg.rope_theta,
                            "partial_rotary_factor": cfg.partial_rotary_factor},
        "linear_num_key_heads": cfg.linear_num_key_heads, "linear_num_value_heads": cfg.linear_num_value_heads,
        "linear_key_head_dim": cfg.linear_key_head_dim, "linear_value_head_dim": cfg.linear_value_head_dim,
        "linear_conv_kernel_dim": cfg.linear_conv_kernel_dim, "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings, "mtp_num_hidden_layers": cfg.mtp_num_hidden_layers,
        "eos_token_id": cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else list(cfg.eos_token_ids),
        "pad_token_id": cfg.eos_token_ids[0] if cfg.eos_token_ids else None,
        "max_position_embeddings": cfg.max_position_embeddings, "initializer_range": 0.02,
        "torch_dtype": "float32", "use_cache": True,
    }


def save_target(path: str | Path, target: Target, *, matrix_dtype=None) -> None:
    """Writes config.json and model.safetensors (checkpoint keys = module paths; MTP head if present), as the
    params are (f32), or with every matrix (ndim >= 2) in ``matrix_dtype`` (e.g. bfloat16: half the bytes; the
    loaders cast to the dtype they are asked for) and the vectors (norms, GDN decays) as they are."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = hf_config(target.cfg)
    if matrix_dtype is not None:
        config["torch_dtype"] = jnp.dtype(matrix_dtype).name
    atomic.write_text(path / "config.json", json.dumps(config, indent=2))  # each file whole
    checkpoint.write_safetensors(path / "model.safetensors",
                                 checkpoint.matrices_in(hf_tensors(target.cfg, target.params), matrix_dtype),
                                 metadata={"format": "pt"})


def lm_loss_fn(graphdef):
    """Next-token cross entropy over every position of [B, T] windows, via ``target.forward``."""
    def loss_fn(params, frozen, tokens):
        logits = forward(graphdef, params, tokens).logits[:, :-1].astype(jnp.float32)  # [B, T-1, V]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        return loss, {}
    return loss_fn


def train_target(cfg: TargetConfig, batches, tcfg: loop.TrainConfig, *, seed: int = 0,
                 ckpt_dir: str | Path | None = None, log_file: str | Path | None = None,
                 init: Target | None = None) -> tuple[Target, loop.Result]:
    """Pretrains a target (no MTP head) with next-token CE, from fresh weights or from ``init`` (a warm start,
    e.g. ``grow.grow``'s, of config ``cfg``); returns it and the loop's result."""
    if init is not None and init.cfg != cfg:
        raise ValueError(f"train_target: the warm start's config differs from {cfg}")
    target = init_target(cfg, dtype=jnp.float32, mtp=False, seed=seed) if init is None else init
    res = loop.train(lm_loss_fn(target.graphdef), target.params, None, batches, tcfg, ckpt_dir=ckpt_dir,
                     desc="target", log_file=log_file, meta={"gdn_channels": GDN_LAYOUT})
    return Target(cfg, target.graphdef, res.params), res


def heldout_loss(target: Target, windows: np.ndarray, batch: int = 8) -> float:
    """Mean next-token CE of the target over fixed windows [N, T]."""
    chunks = [jnp.asarray(windows[i:i + batch]) for i in range(0, len(windows), batch)]
    return loop.evaluate(lm_loss_fn(target.graphdef), target.params, None, chunks)


def distinct_ngram_ratio(tokens, n: int = 4) -> float:
    """Distinct n-grams / n-grams of one token sequence: about 1 for prose or code, near 0 for a loop."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / max(1, len(grams))


def continuation_quality(target: Target, prompts: list[list[int]], new_tokens: int = 128, n: int = 4,
                         loop_below: float = 0.5) -> dict:
    """Greedy continuations of ``prompts`` (no stop ids) scored by distinct n-gram ratio.

    Returns {"ratios": [...], "loops": how many ratios are below ``loop_below``, "tokens": continuations}.
    """
    from dflash_jax.decoding.api import generate
    out = np.asarray(generate(target, prompts, block_size=1, max_new_tokens=new_tokens, stop_ids=()).tokens)
    ratios = [distinct_ngram_ratio(row.tolist(), n) for row in out]
    return {"ratios": ratios, "loops": sum(r < loop_below for r in ratios), "tokens": out.tolist()}


def param_count(params) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
