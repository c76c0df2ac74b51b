"""Models without a checkpoint: random weights from a config alone, or abstract shapes only.

Where it sits: beside the loaders (``target.load_target``, ``drafter.load_drafter``), producing the same
``Target`` / ``Drafter`` objects, for speed measurements at shapes no checkpoint here has: the bench's
random-weight runs, the GPU check (``dflash_jax/perf/gpu_check.py``) and the HLO performance model
(``perf_model.py``). ``random_target`` / ``random_drafter`` initialise the parameters inside one jitted
program, so they are created on the device (a 27B target never passes through host memory);
``abstract_target`` / ``abstract_drafter`` give ``jax.ShapeDtypeStruct`` leaves for ``jit(...).lower``.

``REAL_SHAPES`` holds the ``config.json`` fields of Qwen3.5-27B and 35B-A3B and of DFlash drafters for
them (the published Qwen3.5 and z-lab DFlash config.json files). The released Qwen3.5-27B drafter's config was not
readable; its shape follows z-lab's Qwen3.6-27B drafter (5 layers, width 5120, MLP 17408, 32 / 8 heads of
128) with every layer full attention.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.models.drafter import DFlashDrafter, Drafter, check_fits
from dflash_jax.models.target import Qwen35ForCausalLM, Target

_QWEN35 = dict(
    vocab_size=248320, rms_norm_eps=1e-6, tie_word_embeddings=False, full_attention_interval=4,
    linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
    head_dim=256, mtp_num_hidden_layers=1, max_position_embeddings=262144,
    rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25))
_DRAFTER = dict(architectures=["DFlashDraftModel"], model_type="qwen3", vocab_size=248320, head_dim=128,
                num_attention_heads=32, rms_norm_eps=1e-6, rope_theta=1e7, block_size=16)
REAL_SHAPES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "27b": (
        dict(_QWEN35, architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", hidden_size=5120,
             num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4, linear_num_value_heads=48,
             intermediate_size=17408),
        dict(_DRAFTER, hidden_size=5120, num_hidden_layers=5, num_key_value_heads=8, intermediate_size=17408,
             num_target_layers=64, dflash_config=dict(mask_token_id=248070, target_layer_ids=[1, 16, 31, 46, 61])),
    ),
    "35b-a3b": (
        dict(_QWEN35, architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text", hidden_size=2048,
             num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2, linear_num_value_heads=32,
             num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
             shared_expert_intermediate_size=512),
        dict(_DRAFTER, hidden_size=2048, num_hidden_layers=8, num_key_value_heads=4, intermediate_size=6144,
             num_target_layers=40, dflash_config=dict(mask_token_id=248070, target_layer_ids=[1, 10, 19, 28, 37])),
    ),
}


# z-lab's released Qwen3.8-27B-DFlash2 drafter (no Qwen3.5 one is released): block 8, every one of its five
# layers a sliding window of 2048 keys, and DFlash2's four fields (``train.drafter.DFLASH2``).
DFLASH2_RELEASED = dict(block_size=8, sliding_window=2048)


def dflash2_drafter(drafter: dict[str, Any]) -> dict[str, Any]:
    """A DFlash drafter's ``config.json`` dict (e.g. ``REAL_SHAPES[...][1]``) made the released DFlash2 drafter of
    its shape: ``DFLASH2_RELEASED`` (every layer sliding) and DFlash2's convolution and selector settings."""
    from dflash_jax.train.drafter import DFLASH2  # the released settings, where training takes them from

    layers = drafter["num_hidden_layers"]
    return dict(drafter, architectures=["DFlash2DraftModel"], block_size=DFLASH2_RELEASED["block_size"],
                use_sliding_window=True, sliding_window=DFLASH2_RELEASED["sliding_window"],
                layer_types=["sliding_attention"] * layers,
                dflash_config=dict(drafter["dflash_config"], **DFLASH2))


def _config(cls, config):
    """A ``cls`` config from itself, a raw ``config.json`` dict, or a checkpoint directory / config file."""
    if isinstance(config, cls):
        return config
    return cls.from_hf(config) if isinstance(config, dict) else cls.from_pretrained(config)


def target_config(config: TargetConfig | dict | str | Path) -> TargetConfig:
    """A TargetConfig from itself, a raw ``config.json`` dict, or a checkpoint directory / config file."""
    return _config(TargetConfig, config)


def drafter_config(config: DrafterConfig | dict | str | Path) -> DrafterConfig:
    """Like ``target_config``, for a z-lab drafter config."""
    return _config(DrafterConfig, config)


def _on_device(build, seed: int):
    """(graphdef, params): the module's graph from an abstract build, its parameters made by one jitted program."""
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: build(nnx.Rngs(0))))
    params = jax.jit(lambda key: nnx.state(build(nnx.Rngs(params=key))))(jax.random.key(seed))
    return graphdef, params


def random_target(config, *, dtype=jnp.bfloat16, mtp: bool = False, seed: int = 0,
                  kernels: str | None = None) -> Target:
    """A target of ``config``'s shape with random weights (N(0, 0.02^2) matrices, neutral norms), made on
    the default device. ``config``: a TargetConfig, a raw config.json dict, or a path; ``kernels``: the
    kernel mode (None: ``kernels.default_mode()``)."""
    cfg = target_config(config)
    graphdef, params = _on_device(
        lambda rngs: Qwen35ForCausalLM(cfg, dtype=dtype, mtp=mtp, kernels=kernels, rngs=rngs), seed)
    return Target(cfg, graphdef, params)


def random_drafter(config, target: Target, *, dtype=None, seed: int = 1, kernels: str | None = None) -> Drafter:
    """A DFlash drafter of ``config``'s shape with random weights for ``target`` (dtype: the target's)."""
    cfg = drafter_config(config)
    check_fits(cfg, target.cfg)
    dtype = target.dtype if dtype is None else dtype
    graphdef, params = _on_device(lambda rngs: DFlashDrafter(cfg, dtype=dtype, kernels=kernels, rngs=rngs), seed)
    return Drafter(cfg, graphdef, params)


def abstract_target(config, *, dtype=jnp.bfloat16, mtp: bool = False, kernels: str | None = None) -> Target:
    """A target whose params are ``jax.ShapeDtypeStruct`` leaves (nothing allocated), for lowering."""
    cfg = target_config(config)
    graphdef, params = nnx.split(nnx.eval_shape(
        lambda: Qwen35ForCausalLM(cfg, dtype=dtype, mtp=mtp, kernels=kernels, rngs=nnx.Rngs(0))))
    return Target(cfg, graphdef, params)


def abstract_drafter(config, *, dtype=jnp.bfloat16, kernels: str | None = None, window: int | None = None) -> Drafter:
    """A drafter with ``jax.ShapeDtypeStruct`` params, for lowering; ``window``: ``load_drafter``'s draft window."""
    cfg = drafter_config(config)
    if window is not None:
        cfg = dataclasses.replace(cfg, draft_window=window)  # validated: an integer >= block_size
    graphdef, params = nnx.split(nnx.eval_shape(
        lambda: DFlashDrafter(cfg, dtype=dtype, kernels=kernels, rngs=nnx.Rngs(0))))
    return Drafter(cfg, graphdef, params)
