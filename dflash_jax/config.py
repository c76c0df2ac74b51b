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
import fnmatch
import functools
import json
import math
import re
import warnings
from pathlib import Path
from typing import Any

import regex

from dflash_jax.kernels.mxfp4 import BLOCK, SCALE_MODES

ROPE_TYPES = ("default", "linear", "yarn", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A resolved ``rope_parameters`` dict (defaults filled in as transformers fills them); hashable."""

    rope_type: str = "default"
    factor: float = 1.0  # linear, yarn, llama3
    original_max_position_embeddings: int = 0  # yarn, llama3
    attention_factor: float | None = None  # yarn: None -> from factor (and mscale / mscale_all_dim)
    mscale: float | None = None
    mscale_all_dim: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type {self.rope_type!r} is not one of {ROPE_TYPES}")

    def to_hf(self) -> dict:
        """The ``rope_parameters`` entries of this type (rope_theta and the rotary fraction are the caller's)."""
        keys = _KEYS[self.rope_type]
        return {"rope_type": self.rope_type, **{k: getattr(self, k) for k in keys if getattr(self, k) is not None}}


_KEYS = {
    "default": (),
    "linear": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "mscale", "mscale_all_dim",
             "beta_fast", "beta_slow", "truncate"),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
}


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

    def boolean(self, key: str, default: Any = KeyError) -> Any:
        """A JSON boolean; a missing or null value takes ``default``. A string such as "false" is refused (Python's
        truthiness would read it as true)."""
        value = self.get(key)
        if value is None:
            if default is KeyError:
                raise KeyError(self._name(key))
            return default
        if not isinstance(value, bool):
            raise ConfigError(f"{self._name(key)} must be true or false (a JSON boolean), got {value!r}"
                              + (" (a string)" if isinstance(value, str) else ""))
        return value

    def optional_integer(self, key: str, *, low: int = 1) -> int | None:
        """An integer >= low, or None where the key is missing or null."""
        return self.integer(key, None, low=low) if self.has(key) else self.get(key)

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
        if not any(_same(value, a) for a in allowed):
            kinds = {_json_kind(a) for a in allowed}
            if _json_kind(value) not in kinds:
                raise ConfigError(f"{self._name(key)} must be a JSON {' or '.join(sorted(kinds))}, got {value!r}")
            raise ConfigError(f"{self._name(key)}={value!r} is not supported ({why})")

    def warn_unknown(self, source: str, known: frozenset = frozenset()) -> None:
        unknown = sorted(set(self.raw) - self.read - METADATA_KEYS - known)
        if unknown:
            warnings.warn(f"{source}: unknown {self.where.rstrip('.') or 'config'} fields {unknown} are not used",
                          ConfigWarning, stacklevel=3)


def _json_kind(value: Any) -> str:
    """The JSON type of a parsed value: boolean, number, string, array, object or null."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), "null")


def _same(value: Any, allowed: Any) -> bool:
    """Equal and of the same JSON type (Python's ``0 == False`` and ``1 == True`` are not equal here)."""
    return _json_kind(value) == _json_kind(allowed) and value == allowed


def check_layer_types(value: Any, where: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """A ``layer_types`` list: every entry one of ``allowed`` (a list or an object is named, not hashed)."""
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{where}layer_types must be a list, got {value!r}")
    bad = [(i, t) for i, t in enumerate(value) if not isinstance(t, str) or t not in allowed]
    if bad:
        i, t = bad[0]
        raise ConfigError(f"{where}layer_types[{i}] = {t!r} is not a layer type; expected one of {allowed}"
                          + (f" ({len(bad)} bad entries)" if len(bad) > 1 else ""))
    return tuple(value)


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
                          truncate=f.boolean("truncate", True))
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
    # The JSON type of every HF generation field this module compares or reads.
    TYPES = {"do_sample": "boolean", "temperature": "number", "top_k": "number", "top_p": "number",
             "min_p": "number", "typical_p": "number", "repetition_penalty": "number", "presence_penalty": "number",
             "frequency_penalty": "number", "num_beams": "number", "no_repeat_ngram_size": "number",
             "max_length": "number", "max_new_tokens": "number", "use_cache": "boolean",
             "output_attentions": "boolean", "output_hidden_states": "boolean",
             "return_dict_in_generate": "boolean"}


def read_generation_config(path: str | Path) -> GenerationConfig:
    """``generation_config.json`` of a checkpoint directory (absent: defaults). Any other field at a value
    that would change HF's output (sampling defaults, penalties, beams) draws one ConfigWarning naming it."""
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return GenerationConfig()
    raw = read_json_object(file, "generation_config.json")
    with parsing(str(file)):
        out = GenerationConfig(eos_token_ids=_eos_ids(raw.get("eos_token_id"), ""))
        for key, kind in GenerationConfig.TYPES.items():  # a string here would be compared, not read
            value = raw.get(key)
            if value is not None and _json_kind(value) != kind:
                raise ConfigError(f"{key} must be a JSON {kind}, got {value!r}")
            if kind == "number" and key not in ("temperature",) and value is not None and not math.isfinite(value):
                raise ConfigError(f"{key} must be finite, got {value!r}")
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
        check_layer_types(self.layer_types, "", LAYER_TYPES)
        for name in ("tie_word_embeddings",):
            need(isinstance(getattr(self, name), bool), f"{name} must be a boolean, got {getattr(self, name)!r}")
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
            layer_types = check_layer_types(layer_types, where, LAYER_TYPES)
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
                tie_word_embeddings=top.boolean("tie_word_embeddings", f.boolean("tie_word_embeddings", False)),
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


# ---------------------------------------------------------------------------------------------
# The DFlash drafter (z-lab's config.json)

DRAFTER_LAYER_TYPES = ("full_attention", "sliding_attention")
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def default_target_layer_ids(num_target_layers: int, n: int) -> tuple[int, ...]:
    """z-lab's spread of n tapped layers over a target of L layers: from layer 1 to layer L - 3."""
    if n == 1:
        return (num_target_layers // 2,)
    return tuple(round(1 + i * (num_target_layers - 4) / (n - 1)) for i in range(n))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterConfig:
    """A z-lab DFlash drafter (``DFlashDraftModel``, Qwen3 layers; with the four DFlash2 fields set, a
    ``DFlash2DraftModel``): field names and layouts as its config.json."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = DEFAULT_THETA
    rope_scaling: RopeScaling = RopeScaling()
    layer_types: tuple[str, ...] = ()  # empty: all "full_attention"
    sliding_window: int | None = None
    is_causal: bool | None = None  # overrides every layer's causality when set
    target_hidden_size: int | None = None  # width of one tap; None: hidden_size
    # z-lab's optional transforms: block embeddings times input_embedding_scale; draft logits times
    # output_multiplier, then tanh-softcapped at final_logit_softcapping (None: off).
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    # DFlash2 (z-lab's ``DFlash2DraftModel``): all four set, or none (a DFlash drafter). Each layer's
    # attention and MLP are wrapped in grouped dynamic causal convolutions of conv_kernel_size taps, one
    # dynamic kernel per conv_group_size channels; the candidate selector rescores the drafter's top
    # selector_top_k tokens with a rank-selector_rank predecessor x hidden x successor term.
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    # A load-time bound on the draft context (``--draft-window``; not a checkpoint field, ``to_hf`` leaves it
    # out): every layer's block sees at most the last draft_window context positions before it, plus the block
    # under the layer's own causal rule and window. None: the whole context.
    draft_window: int | None = None

    @property
    def dflash2(self) -> bool:
        """A DFlash2 drafter (convolutions and candidate selector)."""
        return self.conv_kernel_size is not None

    def __post_init__(self):
        # Normalise first (frozen, so via object.__setattr__): tuples keep the config hashable.
        fill = object.__setattr__
        fill(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        fill(self, "layer_types", tuple(self.layer_types) or ("full_attention",) * self.num_hidden_layers)
        if self.target_hidden_size is None:
            fill(self, "target_hidden_size", self.hidden_size)

        def need(ok: bool, msg: str):
            if not ok:
                raise ConfigError(msg)

        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "intermediate_size", "vocab_size", "block_size", "num_target_layers",
                     "target_hidden_size"):
            value = getattr(self, name)
            need(isinstance(value, int) and value > 0, f"{name} must be a positive integer, got {value!r}")
        for name in ("rms_norm_eps", "rope_theta", "input_embedding_scale", "output_multiplier"):
            value = getattr(self, name)
            need(isinstance(value, int | float) and math.isfinite(value) and value > 0,
                 f"{name} must be a finite number > 0, got {value!r}")
        cap = self.final_logit_softcapping
        need(cap is None or (isinstance(cap, int | float) and math.isfinite(cap) and cap > 0),
             f"final_logit_softcapping={cap!r} must be > 0 or null")
        dflash2 = {name: getattr(self, name) for name in DFLASH2_FIELDS}
        unset = [name for name, value in dflash2.items() if value is None]
        need(len(unset) in (0, len(dflash2)), f"a DFlash2 drafter needs all of {list(DFLASH2_FIELDS)}; "
             f"{unset} missing")
        if not unset:
            for name, value in dflash2.items():
                need(isinstance(value, int) and not isinstance(value, bool) and value > 0,
                     f"{name} must be a positive integer, got {value!r}")
            need(self.hidden_size % self.conv_group_size == 0,
                 f"hidden_size={self.hidden_size} is not a multiple of conv_group_size={self.conv_group_size}")
            need(self.selector_top_k <= self.vocab_size,
                 f"selector_top_k={self.selector_top_k} exceeds vocab_size={self.vocab_size}")
        need(self.num_attention_heads % self.num_key_value_heads == 0,
             f"num_attention_heads={self.num_attention_heads} is not a multiple of "
             f"num_key_value_heads={self.num_key_value_heads}")
        need(self.head_dim % 2 == 0, f"head_dim={self.head_dim} must be even (RoPE rotates halves)")
        need(isinstance(self.mask_token_id, int) and self.mask_token_id >= 0,
             f"mask_token_id={self.mask_token_id!r} must be an integer >= 0")
        need(len(self.target_layer_ids) > 0, "target_layer_ids is empty")
        need(all(0 <= i < self.num_target_layers for i in self.target_layer_ids),
             f"target_layer_ids {list(self.target_layer_ids)} must lie in 0..num_target_layers-1 "
             f"(num_target_layers={self.num_target_layers})")
        need(len(self.layer_types) == self.num_hidden_layers,
             f"layer_types has {len(self.layer_types)} entries but num_hidden_layers={self.num_hidden_layers}")
        check_layer_types(self.layer_types, "", DRAFTER_LAYER_TYPES)
        need(self.block_size >= 2, f"block_size={self.block_size}: a DFlash drafter drafts block_size - 1 tokens "
             "after the anchor, so it needs block_size >= 2 (block size 1 is plain decoding, with no drafter)")
        for i, kind in enumerate(self.layer_types):
            if kind != "sliding_attention":
                continue
            need(isinstance(self.sliding_window, int) and self.sliding_window > 0,
                 f"layer {i} is sliding_attention but sliding_window={self.sliding_window!r}")
            # The attention kernel bounds the window only below (keys before the query); a non-causal
            # window narrower than the block would also have to hide keys after the query.
            need(self.layer_causal(i) or self.sliding_window >= self.block_size,
                 f"layer {i}: a non-causal sliding_window={self.sliding_window} must be >= "
                 f"block_size={self.block_size}")

        dw = self.draft_window
        need(dw is None or (isinstance(dw, int) and not isinstance(dw, bool) and dw >= self.block_size),
             f"draft window {dw!r} must be an integer >= the drafter's block_size {self.block_size}")

    def layer_context(self, i: int) -> int | None:
        """The most context positions before the block that any query of layer i can see: the draft window, and
        a sliding window W (the block's first query sees W - 1 keys before it); None: the whole context."""
        bounds = [b for b in (self.draft_window, self.layer_window(i)) if b is not None]
        if self.layer_window(i) is not None:
            bounds[-1] -= 1
        return min(bounds) if bounds else None

    def layer_causal(self, i: int) -> bool:
        """Causal inside the block: z-lab's rule, sliding layers are causal unless is_causal says otherwise."""
        return self.is_causal if self.is_causal is not None else self.layer_types[i] == "sliding_attention"

    def layer_window(self, i: int) -> int | None:
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None

    @classmethod
    def from_hf(cls, raw: dict[str, Any], source: str = "config.json") -> DrafterConfig:
        """Parses a z-lab ``config.json`` (model_type qwen3). As z-lab's ``_draft_value``, the DFlash fields
        (block_size, mask_token_id, target_layer_ids, ...) are read from ``dflash_config`` first, then from
        the top level; block_size defaults to 16 there."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: must be a JSON object, not a {type(raw).__name__}")
        if "dflash_config" not in raw and "block_size" not in raw:
            raise ConfigError(f"{source}: not a DFlash drafter config (no dflash_config or block_size; "
                              f"architectures {raw.get('architectures')})")
        f = Fields(raw)
        with parsing(source):
            dflash = raw.get("dflash_config") or {}
            if not isinstance(dflash, dict):
                raise ConfigError(f"dflash_config must be an object, got {dflash!r}")
            d = Fields(dflash, "dflash_config.")
            f.read.add("dflash_config")

            def pick(key: str) -> Fields:  # z-lab's _draft_value: dflash_config first, then the top level
                return d if d.has(key) else f

            # DFlash2 when z-lab's class is named or any of its fields is set; then all four are required.
            dflash2 = "DFlash2DraftModel" in (raw.get("architectures") or []) or any(
                pick(k).has(k) for k in DFLASH2_FIELDS)

            f.require("hidden_act", ("silu",), "silu", "the drafter MLP uses SiLU")
            f.require("attention_bias", (False,), False, "no z-lab drafter has projection biases")
            f.require("attention_dropout", (0, 0.0), 0.0, "no dropout")
            d.require("use_swa", (False,), False, "sliding windows come from layer_types and sliding_window")
            d.require("attention_sink_bias", (False,), False, "no attention sinks")
            n_layers = f.integer("num_hidden_layers")
            max_pos = f.integer("max_position_embeddings", 32768)
            rope, scaling = rope_scaling(f, max_position_embeddings=max_pos)
            if rope.number("partial_rotary_factor", 1.0) != 1.0:
                raise ConfigError(f"{rope.where}partial_rotary_factor != 1 is not supported "
                                  "(the drafter rotates the whole head)")
            # transformers' Qwen3Config: use_sliding_window=false drops the window; without layer_types, layers
            # from max_window_layers on slide. (use_sliding_window absent: explicit layer_types decide.)
            use_window = f.boolean("use_sliding_window", "layer_types" in raw)
            window = f.optional_integer("sliding_window") if use_window else None
            layer_types = f.get("layer_types") or [
                "sliding_attention" if window is not None and i >= f.integer("max_window_layers", 28, low=0)
                else "full_attention" for i in range(n_layers)]
            layer_types = check_layer_types(layer_types, "", DRAFTER_LAYER_TYPES)
            if "sliding_attention" in layer_types and not use_window:
                raise ConfigError("layer_types has sliding_attention layers but use_sliding_window is false "
                                  "(transformers then drops the window)")
            ids = pick("target_layer_ids").get("target_layer_ids")
            if ids is None:
                ids = default_target_layer_ids(f.integer("num_target_layers"), n_layers)
            elif not isinstance(ids, list) or not all(type(i) is int for i in ids):
                raise ConfigError(f"target_layer_ids must be a list of layer indices, got {ids!r}")
            # `is_causal: false` is meaningful (it makes sliding layers bidirectional): test for None.
            is_causal = f.boolean("is_causal", None)
            if is_causal is None:
                is_causal = d.boolean("causal", None)
            cap = pick("final_logit_softcapping").number("final_logit_softcapping", 0.0, positive=False)
            if cap < 0:
                raise ConfigError(f"final_logit_softcapping={cap} must be >= 0 (0 or null: off)")
            heads = f.integer("num_attention_heads")
            cfg = cls(
                hidden_size=f.integer("hidden_size"),
                num_hidden_layers=n_layers,
                num_attention_heads=heads,
                num_key_value_heads=f.integer("num_key_value_heads"),
                head_dim=f.integer("head_dim", f.integer("hidden_size") // heads),
                intermediate_size=f.integer("intermediate_size"),
                rms_norm_eps=f.number("rms_norm_eps", 1e-6),
                rope_theta=rope.number("rope_theta", f.number("rope_theta", DEFAULT_THETA)),
                rope_scaling=scaling,
                vocab_size=f.integer("vocab_size"),
                block_size=pick("block_size").integer("block_size", 16),
                mask_token_id=pick("mask_token_id").integer("mask_token_id", low=0),
                target_layer_ids=tuple(ids),
                num_target_layers=f.integer("num_target_layers"),
                layer_types=tuple(layer_types),
                sliding_window=window,
                is_causal=None if is_causal is None else bool(is_causal),
                target_hidden_size=f.integer("target_hidden_size", f.integer("hidden_size")),
                input_embedding_scale=pick("input_embedding_scale").number("input_embedding_scale", 1.0),
                output_multiplier=pick("output_multiplier").number("output_multiplier", 1.0),
                final_logit_softcapping=cap or None,
                **{k: pick(k).integer(k) if dflash2 else None for k in DFLASH2_FIELDS},
            )
        d.read |= {"block_size", "mask_token_id", "target_layer_ids", "input_embedding_scale", "output_multiplier",
                   "final_logit_softcapping", "mask_token", *DFLASH2_FIELDS}
        f.read |= {"use_sliding_window", "sliding_window", "max_window_layers", "block_size", "mask_token_id",
                   "target_layer_ids", "input_embedding_scale", "output_multiplier", "final_logit_softcapping",
                   "tie_word_embeddings", *DFLASH2_FIELDS}
        f.warn_unknown(source)
        d.warn_unknown(source)
        return cfg

    @classmethod
    def from_pretrained(cls, path: str | Path) -> DrafterConfig:
        return cls.from_hf(*read_config_json(path))

    def to_hf(self) -> dict[str, Any]:
        """The z-lab ``config.json`` dict; ``from_hf(to_hf())`` gives this config back."""
        rope_parameters = {**self.rope_scaling.to_hf(), "rope_theta": self.rope_theta}
        dflash = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)}
        for key, neutral in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0),
                             ("final_logit_softcapping", None)):
            if getattr(self, key) != neutral:
                dflash[key] = getattr(self, key)
        raw = {
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_act": "silu",
            "attention_bias": False, "tie_word_embeddings": False,
            "hidden_size": self.hidden_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "intermediate_size": self.intermediate_size,
            "rms_norm_eps": self.rms_norm_eps, "rope_parameters": rope_parameters,
            "vocab_size": self.vocab_size, "block_size": self.block_size,
            "num_target_layers": self.num_target_layers, "dflash_config": dflash,
            "layer_types": list(self.layer_types), "sliding_window": self.sliding_window,
            "use_sliding_window": "sliding_attention" in self.layer_types,
        }
        if self.is_causal is not None:
            raw["is_causal"] = self.is_causal
        if self.target_hidden_size != self.hidden_size:
            raw["target_hidden_size"] = self.target_hidden_size
        if self.dflash2:  # z-lab's DFlash2 config: the class name, its fields in dflash_config
            raw["architectures"] = ["DFlash2DraftModel"]
            dflash.update({name: getattr(self, name) for name in DFLASH2_FIELDS})
        return raw


# ---------------------------------------------------------------------------------------------
# MXFP4 storage (AMD Quark's quantization_config)

# What stays bf16 unless told otherwise: Quark's public Qwen3.5 MoE export excludes these (and also
# *.linear_attn.* and *.self_attn.*, which ``--exclude`` adds back). The LM head is shared with the
# drafter, which reads it as a plain matrix, and the MTP head is built dense by its proposer: an
# ``exclude`` that leaves either quantized is refused.
DEFAULT_EXCLUDE = ("lm_head", "model.visual.*", "mtp.*", "*mlp.gate", "*shared_expert_gate*")
_FULL_PREFIX = "model.language_model."  # the multimodal checkpoints' name for our "model."


# Time one "re:" exclude pattern may take on one module name. A pattern from a downloaded config.json must not
# hang the loader: Python's ``re`` backtracks exponentially on patterns such as ``(.|.)*X$`` and has no timeout,
# so patterns are checked with ``re`` (the syntax Quark and vLLM read) and matched with ``regex`` (which has one).
MATCH_TIMEOUT_S = 0.25


@functools.lru_cache(maxsize=256)
def _regex(pattern: str):
    try:
        re.compile(pattern)
        return regex.compile(pattern)
    except (re.error, regex.error, RecursionError, OverflowError) as e:
        raise ConfigError(f"exclude pattern 're:{pattern}' is not a valid regular expression ({e})") from None


def _matches(name: str, pattern: str) -> bool:
    """Quark/vLLM exclude semantics: "re:<regex>" (re.match), a glob if it has * ? [, else equality."""
    if pattern.startswith("re:"):
        try:
            return _regex(pattern[3:]).match(name, timeout=MATCH_TIMEOUT_S) is not None
        except TimeoutError:
            raise ConfigError(f"exclude pattern {pattern!r} took over {MATCH_TIMEOUT_S} s to match the module name "
                              f"{name!r} (catastrophic backtracking, e.g. a repeated group with overlapping "
                              "alternatives such as (.|.)*); simplify it") from None
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return name == pattern


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """Which projections are MXFP4, and how activations are treated.

    exclude: module-name patterns that stay bf16, matched against both our names
      (``model.layers.0.mlp.down_proj``) and the multimodal checkpoints' (``model.language_model...``).
    input_scale_mode: dynamic MXFP4 activations (Quark's ``input_tensors``), emulated as a
      quantize-dequantize of every quantized projection's input with this scale rule; None = off.
    weight_scale_mode: the scale rule used when this library quantizes (``"floor"``: the OCP spec).
    """

    exclude: tuple[str, ...] = DEFAULT_EXCLUDE
    input_scale_mode: str | None = None
    weight_scale_mode: str = "floor"

    def __post_init__(self):
        for pattern in self.exclude:
            if not isinstance(pattern, str):
                raise ConfigError(f"exclude pattern {pattern!r} is not a string")
            if pattern.startswith("re:"):
                _regex(pattern[3:])  # a bad regex is refused here, naming it
        for name, mode in (("input_scale_mode", self.input_scale_mode), ("weight_scale_mode", self.weight_scale_mode)):
            if mode is not None and mode not in SCALE_MODES:
                raise ConfigError(f"QuantConfig.{name}={mode!r}; expected one of {SCALE_MODES}")

    def excludes(self, name: str) -> bool:
        names = (name, _FULL_PREFIX + name[len("model."):]) if name.startswith("model.") else (name,)
        return any(_matches(n, p) for n in names for p in self.exclude)

    @classmethod
    def from_pretrained(cls, path) -> QuantConfig | None:
        """The ``quantization_config`` of a checkpoint's config.json; None for a dense checkpoint."""
        return cls.from_hf(*read_config_json(path))

    @classmethod
    def from_hf(cls, raw: dict, source: str = "config.json") -> QuantConfig | None:
        """Parses Quark's ``quantization_config``; anything this loader cannot honour is a ConfigError
        naming the field."""
        qc = raw.get("quantization_config")
        if qc is None:
            return None
        field = "quantization_config"

        def need(ok, path, msg):
            if not ok:
                raise ConfigError(f"{source}: {field}.{path} {msg}")

        need(isinstance(qc, dict), "", "must be an object")
        method = qc.get("quant_method")
        need(method == "quark", "quant_method", f"= {method!r} is not supported; expected 'quark' (AMD Quark MXFP4)")
        for key in ("layer_quant_config", "layer_type_quant_config"):
            need(not qc.get(key), key, "(per-layer schemes) is not supported: only global_quant_config is")
        g = qc.get("global_quant_config")
        need(isinstance(g, dict), "global_quant_config", "is missing or not an object")
        for key in ("output_tensors", "bias"):
            need(g.get(key) is None, f"global_quant_config.{key}", f"= {g.get(key)!r} is not supported; expected null")
        w = g.get("weight")
        need(isinstance(w, dict), "global_quant_config.weight",
             f"= {w!r} is not supported; expected one MXFP4 spec (dtype fp4, per_group, group_size 32, e8m0)")
        _check_mx_spec(w, "global_quant_config.weight", need, dynamic=False)
        weight_mode = w.get("scale_calculation_mode") or "even"
        need(weight_mode in SCALE_MODES, "global_quant_config.weight.scale_calculation_mode",
             f"= {weight_mode!r} is not supported; expected one of {SCALE_MODES}")
        x = g.get("input_tensors")
        input_mode = None
        if x is not None:
            need(isinstance(x, dict), "global_quant_config.input_tensors", "must be an object or null")
            _check_mx_spec(x, "global_quant_config.input_tensors", need, dynamic=True)
            input_mode = x.get("scale_calculation_mode") or "even"  # Quark's and vLLM's default
            need(input_mode in SCALE_MODES, "global_quant_config.input_tensors.scale_calculation_mode",
                 f"= {input_mode!r} is not supported; expected one of {SCALE_MODES}")
        exclude = qc.get("exclude") or []
        need(isinstance(exclude, list) and all(isinstance(p, str) for p in exclude), "exclude",
             "must be a list of module-name patterns")
        try:
            return cls(exclude=tuple(exclude), input_scale_mode=input_mode, weight_scale_mode=weight_mode)
        except ConfigError as e:
            raise ConfigError(f"{source}: {field}.exclude: {e}") from None

    def to_hf(self, exclude: tuple[str, ...] | None = None) -> dict:
        """Quark's ``quantization_config`` for this config (``exclude`` overrides the pattern list)."""
        spec = {"dtype": "fp4", "qscheme": "per_group", "group_size": BLOCK, "ch_axis": -1, "scale_format": "e8m0",
                "scale_type": "float", "round_method": "half_even", "symmetric": None, "mx_element_dtype": None,
                "observer_cls": "PerBlockMXObserver", "is_scale_quant": False}
        weight = {**spec, "is_dynamic": False, "scale_calculation_mode": self.weight_scale_mode}
        inputs = None if self.input_scale_mode is None else {
            **spec, "is_dynamic": True, "scale_calculation_mode": self.input_scale_mode}
        return {
            "quant_method": "quark",
            "export": {"kv_cache_group": [], "min_kv_scale": 0.0, "pack_method": "reorder",
                       "weight_format": "real_quantized", "weight_merge_groups": None},
            "global_quant_config": {"weight": weight, "input_tensors": inputs, "output_tensors": None, "bias": None},
            "layer_quant_config": {},
            "layer_type_quant_config": {},
            "exclude": list(self.exclude if exclude is None else exclude),
        }


def read_target_config(path) -> tuple[TargetConfig, QuantConfig | None]:
    """A checkpoint directory's architecture and its MXFP4 storage (None: dense). ``TargetConfig``
    refuses ``quantization_config`` by itself (it cannot honour one); here it is parsed and checked,
    and the architecture read without it (generation_config.json's stop ids included)."""
    raw, source = read_config_json(path)
    qcfg = QuantConfig.from_hf(raw, source)
    raw = {k: v for k, v in raw.items() if k != "quantization_config"}
    return TargetConfig.from_hf(raw, source, generation=read_generation_config(path)), qcfg


def _check_mx_spec(spec: dict, path: str, need, *, dynamic: bool):
    need(spec.get("dtype") == "fp4", f"{path}.dtype", f"= {spec.get('dtype')!r} is not supported; expected 'fp4'")
    need(spec.get("qscheme", "per_group") == "per_group", f"{path}.qscheme",
         f"= {spec.get('qscheme')!r} is not supported; expected 'per_group'")
    need(spec.get("group_size") == BLOCK, f"{path}.group_size",
         f"= {spec.get('group_size')!r} is not supported; expected {BLOCK}")
    need(spec.get("scale_format") == "e8m0", f"{path}.scale_format",
         f"= {spec.get('scale_format')!r} is not supported; expected 'e8m0'")
    need(any(_same(spec.get("ch_axis", -1), a) for a in (-1, 1)), f"{path}.ch_axis",
         f"= {spec.get('ch_axis')!r} is not supported; blocks must run along the input dimension (-1)")
    need(spec.get("is_dynamic") is None or isinstance(spec["is_dynamic"], bool), f"{path}.is_dynamic",
         f"= {spec.get('is_dynamic')!r} must be a JSON boolean")
    need(bool(spec.get("is_dynamic")) == dynamic, f"{path}.is_dynamic",
         f"= {spec.get('is_dynamic')!r} is not supported; expected {dynamic}"
         + (" (static input scales)" if dynamic else ""))
