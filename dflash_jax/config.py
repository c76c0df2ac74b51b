"""Frozen, hashable model configs parsed from Hugging Face ``config.json`` files.

This is the top of the data flow: every other module takes a config as a static argument.
``TargetConfig`` describes a Qwen3.5 text decoder (dense or MoE, hybrid Gated DeltaNet + gated
attention) in either checkpoint layout: the official multimodal one (``text_config`` nested under a
``*ForConditionalGeneration`` config) or the text-only ``*ForCausalLM`` one. ``generation_config.json``
adds stop ids (``read_generation_config``).

Every key of a config is either read (and validated), refused with a ``ConfigError`` when it asks for
something this library does not compute, or named in a list of keys that cannot change the computation
(metadata, vision tower, training-only switches); any other key draws a ``ConfigWarning`` naming it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import warnings
from pathlib import Path
from typing import Any

from dflash_jax.rope import RopeScaling

TARGET_ARCHITECTURES = (
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
)
LAYER_TYPES = ("linear_attention", "full_attention")
DEFAULT_THETA = 10_000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta

# Keys that cannot change what the model computes from its weights: provenance, HF runtime switches,
# token ids used only by HF's own padding/generation, initialisation (weights are loaded), and the
# multimodal wrapper's vision tower (out of scope: text only).
METADATA_KEYS = frozenset({
    "architectures", "model_type", "transformers_version", "_name_or_path", "auto_map", "dtype", "torch_dtype",
    "use_cache", "return_dict", "output_hidden_states", "output_attentions", "output_router_logits",
    "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type", "tokenizer_class",
    "bos_token_id", "pad_token_id", "initializer_range", "router_aux_loss_coef", "_attn_implementation",
    "vision_config", "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
    "text_config", "max_window_layers",
})


class ConfigError(ValueError):
    """A config.json that cannot describe a model this library runs."""


class ConfigWarning(UserWarning):
    """A config key this library does not know; it is not used."""


def read_json_object(file: Path, what: str) -> dict[str, Any]:
    """A JSON file that must hold an object, with clear errors naming the file."""
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{file}: cannot read {what}: {e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: {what} must be a JSON object, not a {type(raw).__name__}")
    return raw


def read_config_json(path: str | Path) -> tuple[dict[str, Any], str]:
    """Reads ``config.json`` from a checkpoint directory (or the file itself) with clear errors.

    Returns the parsed dict and the file's name, for error messages.
    """
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"{file}: no config.json (is {path} a Hugging Face checkpoint directory?)")
    return read_json_object(file, "config.json"), str(file)


@contextlib.contextmanager
def parsing(source: str):
    """Turns a missing key or a failed validation while parsing ``source`` into a ConfigError naming it."""
    try:
        yield
    except KeyError as e:
        raise ConfigError(f"{source}: missing required field {e.args[0]!r}") from None
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


class Fields:
    """Typed, validated reads from one config dict; remembers which keys were read."""

    def __init__(self, raw: dict[str, Any], where: str = ""):
        self.raw, self.where, self.read = raw, where, set()

    def _name(self, key: str) -> str:
        return f"{self.where}{key}"

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        value = self.raw.get(key)
        return default if value is None else value

    def has(self, key: str) -> bool:
        return self.raw.get(key) is not None

    def integer(self, key: str, default: Any = KeyError, *, low: int = 1) -> int:
        """An integer >= low; a missing or null value takes ``default`` (KeyError: required)."""
        value = self.get(key)
        if value is None:
            if default is KeyError:
                raise KeyError(self._name(key))
            value = default
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"{self._name(key)} must be an integer >= {low}, got {value!r}")
        return value

    def number(self, key: str, default: float, *, positive: bool = True) -> float:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or (
                positive and value <= 0):
            raise ConfigError(f"{self._name(key)} must be a finite number{' > 0' if positive else ''}, "
                              f"got {value!r}")
        return float(value)

    def require(self, key: str, allowed: tuple, default: Any, why: str) -> None:
        """Refuses a value of ``key`` outside ``allowed`` (a missing key is ``default``)."""
        value = self.get(key, default)
        if value not in allowed:
            raise ConfigError(f"{self._name(key)}={value!r} is not supported ({why})")

    def warn_unknown(self, source: str, known: frozenset = frozenset()) -> None:
        unknown = sorted(set(self.raw) - self.read - METADATA_KEYS - known)
        if unknown:
            warnings.warn(f"{source}: unknown {self.where.rstrip('.') or 'config'} fields {unknown} are not used",
                          ConfigWarning, stacklevel=3)


def rope_scaling(config: Fields, *, max_position_embeddings: int) -> tuple[Fields, RopeScaling]:
    """Reads a model config's ``rope_parameters`` (or the legacy ``rope_scaling``) from its fields ``config``:
    the rope type and its parameters, parsed the way transformers resolves them (``standardize_rope_params``,
    ``_compute_*_parameters``); refuses types whose frequencies depend on the sequence length. Returns the
    parameters' own fields too, for the caller's ``rope_theta`` / ``partial_rotary_factor`` reads."""
    key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    params = config.get(key, {})
    if not isinstance(params, dict):
        raise ConfigError(f"{config.where}{key} must be an object, got {params!r}")
    f = Fields(params, f"{config.where}{key}.")
    f.read |= {"rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"}  # read by the caller;
    # M-RoPE sections only matter for image/video positions: for text all three position rows are equal.
    kind = params.get("rope_type", params.get("type")) or "default"
    f.read |= {"rope_type", "type"}
    if kind == "default":
        out = RopeScaling()
    elif kind == "linear":
        out = RopeScaling("linear", factor=f.number("factor", None))
    elif kind == "yarn":
        original = f.integer("original_max_position_embeddings", max_position_embeddings)
        optional = {k: f.number(k, None, positive=k == "attention_factor")
                    for k in ("attention_factor", "mscale", "mscale_all_dim") if f.has(k)}
        out = RopeScaling("yarn", factor=f.number("factor", max_position_embeddings / original),
                          original_max_position_embeddings=original, **optional,
                          beta_fast=f.number("beta_fast", 32.0) if f.get("beta_fast") else 32.0,  # `or 32`, as HF
                          beta_slow=f.number("beta_slow", 1.0) if f.get("beta_slow") else 1.0,
                          truncate=bool(f.get("truncate", True)))
    elif kind == "llama3":
        out = RopeScaling("llama3", factor=f.number("factor", None),
                          original_max_position_embeddings=f.integer("original_max_position_embeddings",
                                                                 max_position_embeddings),
                          low_freq_factor=f.number("low_freq_factor", None),
                          high_freq_factor=f.number("high_freq_factor", None))
        if out.high_freq_factor <= out.low_freq_factor:
            raise ConfigError(f"{f.where}high_freq_factor must be > low_freq_factor")
    else:
        raise ConfigError(f"{f.where}rope_type {kind!r} is not supported (supported: default, linear, yarn, llama3; "
                          f"'dynamic' and 'longrope' change with the sequence length)")
    unknown = sorted(set(params) - f.read)
    if unknown:
        raise ConfigError(f"{f.where.rstrip('.')} fields {unknown} are not understood for rope_type {kind!r}")
    return f, out


def _eos_ids(value: Any, where: str) -> tuple[int, ...]:
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConfigError(f"{where}eos_token_id must be a token id or a list of them, got {value!r}")
    return tuple(ids)


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """What this library takes from ``generation_config.json``: the stop ids. Sampling is chosen per call
    (``SamplingConfig``, the CLI's ``--temperature``/``--top-k``/``--top-p``), greedy by default."""

    eos_token_ids: tuple[int, ...] = ()

    # Keys whose values change nothing here (HF generate() runtime switches and token bookkeeping).
    IGNORED = frozenset({"_from_model_config", "transformers_version", "bos_token_id", "pad_token_id",
                         "output_attentions", "output_hidden_states", "use_cache", "return_dict_in_generate",
                         "max_length", "max_new_tokens"})
    # HF's values at which a knob does nothing; the sampling knobs also do nothing while do_sample is false.
    NEUTRAL = {"do_sample": False, "repetition_penalty": 1.0, "min_p": 0.0, "presence_penalty": 0.0,
               "frequency_penalty": 0.0, "num_beams": 1, "no_repeat_ngram_size": 0, "typical_p": 1.0}
    SAMPLING = frozenset({"temperature", "top_k", "top_p", "min_p", "typical_p"})


def read_generation_config(path: str | Path) -> GenerationConfig:
    """``generation_config.json`` of a checkpoint directory (absent: defaults). Any other field at a value
    that would change HF's output (sampling defaults, penalties, beams) draws one ConfigWarning naming it."""
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return GenerationConfig()
    raw = read_json_object(file, "generation_config.json")
    with parsing(str(file)):
        out = GenerationConfig(eos_token_ids=_eos_ids(raw.get("eos_token_id"), ""))
    sampling = bool(raw.get("do_sample"))
    odd = sorted(k for k, v in raw.items() if k != "eos_token_id" and k not in GenerationConfig.IGNORED
                 and v is not None and v != GenerationConfig.NEUTRAL.get(k, object())
                 and (sampling or k not in GenerationConfig.SAMPLING))
    if odd:
        warnings.warn(f"{file}: fields {odd} are not applied by this library (decoding is greedy unless a "
                      "SamplingConfig or --temperature/--top-k/--top-p is given)", ConfigWarning, stacklevel=2)
    return out


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """A Qwen3.5 text decoder. Field names and defaults follow the HF config (``Qwen3_5TextConfig``)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    # Gated full attention.
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = DEFAULT_THETA
    partial_rotary_factor: float = 0.25
    rope_scaling: RopeScaling = RopeScaling()
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
    eos_token_ids: tuple[int, ...] = ()  # config.json's and generation_config.json's, in that order
    max_position_embeddings: int = 32768

    def __post_init__(self):
        def need(ok: bool, msg: str):
            if not ok:
                raise ConfigError(msg)

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_conv_kernel_dim", "max_position_embeddings"):
            value = getattr(self, name)
            need(isinstance(value, int) and value > 0, f"{name} must be a positive integer, got {value!r}")
        for name in ("rms_norm_eps", "rope_theta", "partial_rotary_factor"):
            value = getattr(self, name)
            need(isinstance(value, int | float) and math.isfinite(value) and value > 0,
                 f"{name} must be a finite number > 0, got {value!r}")
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
        need(self.mtp_num_hidden_layers >= 0, f"mtp_num_hidden_layers={self.mtp_num_hidden_layers} must be >= 0")
        bad = [i for i in self.eos_token_ids if not 0 <= i < self.vocab_size]
        need(not bad, f"eos_token_id {bad} outside the vocabulary 0..{self.vocab_size - 1}")
        if self.is_moe:
            need(0 < self.num_experts_per_tok <= self.num_experts,
                 f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts={self.num_experts}")
            need(self.moe_intermediate_size > 0, "MoE config without moe_intermediate_size")
            need(self.shared_expert_intermediate_size > 0, "MoE config without shared_expert_intermediate_size")
        else:
            need(self.intermediate_size > 0, "dense config without intermediate_size")

    # Derived sizes.
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

    @classmethod
    def from_hf(cls, raw: dict[str, Any], source: str = "config.json",
                generation: GenerationConfig = GenerationConfig()) -> TargetConfig:
        """Parses an HF config dict in either layout (nested ``text_config`` or flat); stop ids from
        ``generation`` are appended to config.json's."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: must be a JSON object, not a {type(raw).__name__}")
        archs = raw.get("architectures") or []
        if archs and not any(a in TARGET_ARCHITECTURES for a in archs):
            raise ConfigError(
                f"{source}: architectures {archs} is not a Qwen3.5 text model; expected one of "
                f"{list(TARGET_ARCHITECTURES)}")
        nested = raw.get("text_config")
        if nested is not None and not isinstance(nested, dict):
            raise ConfigError(f"{source}: text_config must be an object, got {nested!r}")
        text = nested or raw
        where = "text_config." if nested else ""
        model_type = text.get("model_type", "")
        if model_type and model_type not in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe"):
            raise ConfigError(f"{source}: model_type {model_type!r} is not a Qwen3.5 text model")
        f, top = Fields(text, where), Fields(raw)
        with parsing(source):
            if "quantization_config" in raw or "quantization_config" in text:
                raise ConfigError("quantization_config: quantized checkpoints are not supported "
                                  "(the loader would read packed weights as plain ones)")
            # Settings the model code has one fixed answer for: anything else is refused.
            f.require("hidden_act", ("silu",), "silu", "the MLP and the Gated DeltaNet conv use SiLU")
            f.require("attention_bias", (False,), False, "no projection has a bias")
            f.require("attention_dropout", (0, 0.0), 0.0, "no dropout")
            f.require("attn_output_gate", (True,), True, "full attention is always sigmoid-gated")
            f.require("output_gate_type", ("swish",), "swish", "the Gated DeltaNet norm gate is SiLU")
            f.require("mamba_ssm_dtype", ("float32",), "float32", "the Gated DeltaNet state is kept in float32")
            f.require("mtp_use_dedicated_embeddings", (False,), False, "MTP shares the target's embedding")
            f.require("use_sliding_window", (False,), False, "Qwen3.5 attention is global")
            f.require("norm_topk_prob", (True,), True, "Qwen3.5 MoE renormalises the top-k weights")
            f.require("decoder_sparse_step", (1,), 1, "every Qwen3.5 MoE layer is sparse")
            f.require("mlp_only_layers", ([],), [], "every Qwen3.5 MoE layer is sparse")
            f.read |= {"sliding_window", "full_attention_interval"}  # the interval only matters without layer_types
            if f.has("sliding_window") and f.raw["sliding_window"] != 0:
                raise ConfigError(f"{where}sliding_window={f.raw['sliding_window']!r} is not supported "
                                  f"(Qwen3.5 attention is global)")

            vocab, hidden, heads = f.integer("vocab_size"), f.integer("hidden_size"), f.integer("num_attention_heads")
            n_layers = f.integer("num_hidden_layers")
            layer_types = f.get("layer_types") or [
                "linear_attention" if (i + 1) % f.integer("full_attention_interval", 4) else "full_attention"
                for i in range(n_layers)
            ]
            if not isinstance(layer_types, list):
                raise ConfigError(f"{where}layer_types must be a list, got {layer_types!r}")
            max_pos = f.integer("max_position_embeddings", 32768)
            rope, scaling = rope_scaling(f, max_position_embeddings=max_pos)
            eos = _eos_ids(f.get("eos_token_id", top.get("eos_token_id")), where)
            cfg = cls(
                vocab_size=vocab,
                hidden_size=hidden,
                num_hidden_layers=n_layers,
                layer_types=tuple(layer_types),
                num_attention_heads=heads,
                num_key_value_heads=f.integer("num_key_value_heads"),
                head_dim=f.integer("head_dim", hidden // heads),
                # rope_parameters first, then the legacy top-level keys, then transformers' defaults.
                rope_theta=rope.number("rope_theta", f.number("rope_theta", DEFAULT_THETA)),
                partial_rotary_factor=rope.number("partial_rotary_factor",
                                                  f.number("partial_rotary_factor", 0.25)),
                rope_scaling=scaling,
                linear_num_key_heads=f.integer("linear_num_key_heads", 16),
                linear_num_value_heads=f.integer("linear_num_value_heads", 32),
                linear_key_head_dim=f.integer("linear_key_head_dim", 128),
                linear_value_head_dim=f.integer("linear_value_head_dim", 128),
                linear_conv_kernel_dim=f.integer("linear_conv_kernel_dim", 4),
                intermediate_size=f.integer("intermediate_size", 0, low=0),
                num_experts=f.integer("num_experts", 0, low=0),
                num_experts_per_tok=f.integer("num_experts_per_tok", 0, low=0),
                moe_intermediate_size=f.integer("moe_intermediate_size", 0, low=0),
                shared_expert_intermediate_size=f.integer("shared_expert_intermediate_size", 0, low=0),
                rms_norm_eps=f.number("rms_norm_eps", 1e-6),
                tie_word_embeddings=bool(top.get("tie_word_embeddings", f.get("tie_word_embeddings", False))),
                mtp_num_hidden_layers=f.integer("mtp_num_hidden_layers", 0, low=0),
                eos_token_ids=tuple(dict.fromkeys(eos + generation.eos_token_ids)),
                max_position_embeddings=max_pos,
            )
        f.warn_unknown(source)
        if nested:
            top.warn_unknown(source)
        return cfg

    @classmethod
    def from_pretrained(cls, path: str | Path) -> TargetConfig:
        """config.json (+ generation_config.json's stop ids when ``path`` is a directory)."""
        generation = read_generation_config(path) if Path(path).is_dir() else GenerationConfig()
        return cls.from_hf(*read_config_json(path), generation=generation)
