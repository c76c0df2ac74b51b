"""Frozen, hashable model configs parsed from Hugging Face ``config.json`` files.

This is the top of the data flow: every other module takes a config as a static argument.
``TargetConfig`` describes a Qwen3.5 text decoder (dense or MoE, hybrid Gated DeltaNet + gated
attention) in either checkpoint layout: the official multimodal one (``text_config`` nested under a
``*ForConditionalGeneration`` config) or the text-only ``*ForCausalLM`` one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from typing import Any

TARGET_ARCHITECTURES = (
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
)
LAYER_TYPES = ("linear_attention", "full_attention")


class ConfigError(ValueError):
    """A config.json that cannot describe a model this library runs."""


def read_config_json(path: str | Path) -> tuple[dict[str, Any], str]:
    """Reads ``config.json`` from a checkpoint directory (or the file itself) with clear errors.

    Returns the parsed dict and the file's name, for error messages.
    """
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.exists():
        raise ConfigError(f"{file}: no config.json (is {path} a Hugging Face checkpoint directory?)")
    try:
        return json.loads(file.read_text()), str(file)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file}: not valid JSON ({e})") from None


@contextlib.contextmanager
def parsing(source: str):
    """Turns a missing key or a failed validation while parsing ``source`` into a ConfigError naming it."""
    try:
        yield
    except KeyError as e:
        raise ConfigError(f"{source}: missing required field {e.args[0]!r}") from None
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """A Qwen3.5 text decoder. Field names follow the HF config; see reference/qwen35.md."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    # Gated full attention.
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 1e7
    partial_rotary_factor: float = 0.25
    # Gated DeltaNet.
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    # Dense MLP (intermediate_size) or MoE (num_experts > 0).
    intermediate_size: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    mtp_num_hidden_layers: int = 0
    eos_token_ids: tuple[int, ...] = ()
    max_position_embeddings: int = 262144

    def __post_init__(self):
        def need(ok: bool, msg: str):
            if not ok:
                raise ConfigError(msg)

        need(len(self.layer_types) == self.num_hidden_layers,
             f"layer_types has {len(self.layer_types)} entries but num_hidden_layers={self.num_hidden_layers}")
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        need(not bad, f"unknown layer_types {bad}; expected {LAYER_TYPES}")
        need(self.num_attention_heads % self.num_key_value_heads == 0,
             f"num_attention_heads={self.num_attention_heads} is not a multiple of "
             f"num_key_value_heads={self.num_key_value_heads}")
        need(self.linear_num_value_heads % self.linear_num_key_heads == 0,
             f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
             f"linear_num_key_heads={self.linear_num_key_heads}")
        need(self.rotary_dim % 2 == 0 and 0 < self.rotary_dim <= self.head_dim,
             f"partial_rotary_factor={self.partial_rotary_factor} gives rotary_dim={self.rotary_dim} "
             f"for head_dim={self.head_dim}; it must be even and in (0, head_dim]")
        if self.is_moe:
            need(0 < self.num_experts_per_tok <= self.num_experts,
                 f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts={self.num_experts}")
            need(self.moe_intermediate_size > 0, "MoE config without moe_intermediate_size")
        else:
            need(self.intermediate_size > 0, "dense config without intermediate_size")

    # Derived sizes (shape letters as in DESIGN.md).
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @classmethod
    def from_hf(cls, raw: dict[str, Any], source: str = "config.json") -> TargetConfig:
        """Parses an HF config dict in either layout (nested ``text_config`` or flat)."""
        archs = raw.get("architectures") or []
        if archs and not any(a in TARGET_ARCHITECTURES for a in archs):
            raise ConfigError(
                f"{source}: architectures {archs} is not a Qwen3.5 text model; expected one of "
                f"{list(TARGET_ARCHITECTURES)}")
        text = dict(raw.get("text_config") or raw)
        model_type = text.get("model_type", "")
        if model_type and model_type not in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe"):
            raise ConfigError(f"{source}: model_type {model_type!r} is not a Qwen3.5 text model")
        with parsing(source):
            n_layers = int(text["num_hidden_layers"])
            layer_types = text.get("layer_types") or [
                "linear_attention" if (i + 1) % int(text.get("full_attention_interval", 4)) else "full_attention"
                for i in range(n_layers)
            ]
            rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
            eos = text.get("eos_token_id", raw.get("eos_token_id"))
            eos = () if eos is None else (tuple(eos) if isinstance(eos, list) else (int(eos),))
            tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
            return cls(
                vocab_size=int(text["vocab_size"]),
                hidden_size=int(text["hidden_size"]),
                num_hidden_layers=n_layers,
                layer_types=tuple(layer_types),
                num_attention_heads=int(text["num_attention_heads"]),
                num_key_value_heads=int(text["num_key_value_heads"]),
                head_dim=int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]),
                rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 1e7))),
                partial_rotary_factor=float(rope.get("partial_rotary_factor",
                                                     text.get("partial_rotary_factor", 0.25))),
                linear_num_key_heads=int(text["linear_num_key_heads"]),
                linear_num_value_heads=int(text["linear_num_value_heads"]),
                linear_key_head_dim=int(text["linear_key_head_dim"]),
                linear_value_head_dim=int(text["linear_value_head_dim"]),
                linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
                intermediate_size=int(text.get("intermediate_size") or 0),
                num_experts=int(text.get("num_experts") or 0),
                num_experts_per_tok=int(text.get("num_experts_per_tok") or 0),
                moe_intermediate_size=int(text.get("moe_intermediate_size") or 0),
                shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size") or 0),
                rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(tie),
                mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers") or 0),
                eos_token_ids=eos,
                max_position_embeddings=int(text.get("max_position_embeddings", 262144)),
            )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> TargetConfig:
        return cls.from_hf(*read_config_json(path))
