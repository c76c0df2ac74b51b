"""MXFP4 target weights: AMD Quark's checkpoint layout, quantized projections in the model, the writer.

Where it sits: between ``layers.py`` and ``target.py``. A projection holds MXFP4 weights when its
module carries a ``<weight>_scale`` parameter beside the packed weight; ``Linear`` and ``Experts``
then compute through ``kernels/mxfp4.py`` (the Pallas kernels on a GPU, a dequantizing reference
elsewhere). ``load_target`` asks this module which projections a checkpoint stores quantized
(``quantize_modules`` on the abstract model) and converts between bf16 and MXFP4 at load time
(``convert``); ``save_quark`` writes a quantized target back in Quark's layout. The drafter never
comes here: it stays bf16.

The format (``kernels/mxfp4.py``): e2m1 codes two per byte, the even-index element
in the low nibble; one e8m0 scale byte s per 32 consecutive inputs, value 2^(s - 127). Parameter
paths stay checkpoint keys: ``<module>.weight`` uint8 [out, in/2] + ``<module>.weight_scale`` uint8
[out, in/32]; the fused MoE experts hold ``experts.gate_up_proj`` [E, 2I, D/2] +
``experts.gate_up_proj_scale`` [E, 2I, D/32] (``down_proj`` likewise), which the checkpoint loader
stacks from Quark's per-expert ``experts.{e}.{gate,up,down}_proj.weight(_scale)`` tensors.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax import atomic, checkpoint
from dflash_jax.config import ConfigError, TargetConfig, read_config_json, read_generation_config
from dflash_jax.kernels import mxfp4
from dflash_jax.kernels.mxfp4 import BLOCK, SCALE_MODES
from dflash_jax.layers import Experts, Linear, hf_tensors

__all__ = [
    "DEFAULT_EXCLUDE", "QuantConfig", "convert", "dequantize_modules", "layout", "plan", "quantize_modules",
    "read_target_config", "restore_layout", "save_quark",
]

# What stays bf16 unless told otherwise: Quark's public Qwen3.5 MoE export excludes these (and also
# *.linear_attn.* and *.self_attn.*, which ``--exclude`` adds back). The LM head is shared with the
# drafter, which reads it as a plain matrix, and the MTP head is built dense by its proposer: an
# ``exclude`` that leaves either quantized is refused.
DEFAULT_EXCLUDE = ("lm_head", "model.visual.*", "mtp.*", "*mlp.gate", "*shared_expert_gate*")
_FULL_PREFIX = "model.language_model."  # the multimodal checkpoints' name for our "model."


def _matches(name: str, pattern: str) -> bool:
    """Quark/vLLM exclude semantics: "re:<regex>" (re.match), a glob if it has * ? [, else equality."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
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
        return cls(exclude=tuple(exclude), input_scale_mode=input_mode, weight_scale_mode=weight_mode)

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
    need(spec.get("ch_axis", -1) in (-1, 1), f"{path}.ch_axis",
         f"= {spec.get('ch_axis')!r} is not supported; blocks must run along the input dimension (-1)")
    need(bool(spec.get("is_dynamic")) == dynamic, f"{path}.is_dynamic",
         f"= {spec.get('is_dynamic')!r} is not supported; expected {dynamic}"
         + (" (static input scales)" if dynamic else ""))


# ---------------------------------------------------------------------------------------------
# The model's projections


def _projections(module):
    """(weight path, owning module, attribute, per-expert module names or None) of every projection
    MXFP4 can hold: each ``Linear``'s weight and each ``Experts``' two fused weights."""
    for path, sub in nnx.iter_graph(module):
        name = ".".join(map(str, path))
        if isinstance(sub, Linear):
            yield f"{name}.weight", sub, "weight", [name]
        elif isinstance(sub, Experts):
            E = sub.down_proj.get_value().shape[0]
            yield (f"{name}.gate_up_proj", sub, "gate_up_proj",
                   [f"{name}.{e}.{p}" for e in range(E) for p in ("gate_proj", "up_proj")])
            yield f"{name}.down_proj", sub, "down_proj", [f"{name}.{e}.down_proj" for e in range(E)]


def plan(module, qcfg: QuantConfig) -> list[str]:
    """Weight paths ``qcfg`` quantizes in ``module``: every projection not excluded whose input width
    is a multiple of 32 (others cannot be blocked and stay bf16)."""
    out = []
    for path, sub, attr, names in _projections(module):
        excluded = [qcfg.excludes(n) for n in names]
        if any(excluded) != all(excluded):
            raise ConfigError(f"quantization_config.exclude matches only some experts of {path!r} "
                              f"({sum(excluded)} of {len(names)} projections); fused experts are all MXFP4 or none")
        if excluded[0]:
            continue
        if path == "lm_head.weight":
            raise ConfigError("quantization_config.exclude must cover 'lm_head': the drafter shares the "
                              "target's LM head and reads it as a bf16 matrix")
        if path.startswith("mtp."):
            raise ConfigError(f"quantization_config.exclude must cover 'mtp.*' ({path!r} is not excluded): the "
                              "MTP proposer builds the head from the config and reads its weights dense")
        width = getattr(sub, attr).get_value().shape[-1] * (2 if hasattr(sub, attr + "_scale") else 1)
        if width % BLOCK == 0:  # the input width, whether the weight is dense or already packed
            out.append(path)
    return out


def _apply(module, paths, input_scale_mode: str | None, scale_mode: str) -> None:
    """Swaps each weight in ``paths`` for packed codes + ``<attr>_scale``: shapes only on an abstract
    module (``nnx.eval_shape``), quantized values on a concrete one."""
    todo = set(paths)
    kernels = getattr(module, "kernels", None)  # the model's kernel mode (layers.with_kernels keeps it in step)
    for path, sub, attr, _ in _projections(module):
        if path not in todo:
            continue
        todo.discard(path)
        w = getattr(sub, attr).get_value()
        if isinstance(w, jax.ShapeDtypeStruct):
            K = w.shape[-1]
            packed = jax.ShapeDtypeStruct((*w.shape[:-1], K // 2), jnp.uint8)
            scale = jax.ShapeDtypeStruct((*w.shape[:-1], K // BLOCK), jnp.uint8)
        else:
            packed, scale = mxfp4.quantize_mxfp4(w, scale_mode)
        setattr(sub, attr, nnx.Param(packed))
        setattr(sub, attr + "_scale", nnx.Param(scale))
        sub.input_scale_mode = input_scale_mode  # static: part of the graph, so of every jit cache key
        if isinstance(sub, Linear):
            sub.kernels = kernels
    if todo:
        raise ConfigError(f"MXFP4 layout names projections this model does not have: {sorted(todo)[:5]}")


def quantize_modules(module, qcfg: QuantConfig) -> list[str]:
    """Quantizes ``module`` in place per ``qcfg`` (see ``plan``); returns the weight paths quantized."""
    paths = plan(module, qcfg)
    _apply(module, paths, qcfg.input_scale_mode, qcfg.weight_scale_mode)
    return paths


def dequantize_modules(module, dtype) -> list[str]:
    """Replaces every MXFP4 weight of ``module`` by its dequantized values in ``dtype``, in place."""
    done = []
    for path, sub, attr, _ in _projections(module):
        if hasattr(sub, attr + "_scale"):
            scale = getattr(sub, attr + "_scale").get_value()
            w = mxfp4.dequantize_mxfp4(getattr(sub, attr).get_value(), scale, dtype)
            setattr(sub, attr, nnx.Param(w))
            delattr(sub, attr + "_scale")
            done.append(path)
            if not any(hasattr(sub, a + "_scale") for a in ("weight", "gate_up_proj", "down_proj")):
                del sub.input_scale_mode
                if isinstance(sub, Linear):
                    del sub.kernels
    return done


def layout(module) -> dict | None:
    """The MXFP4 layout of ``module`` as JSON (for converted copies), None when nothing is quantized."""
    paths, modes = [], set()
    for path, sub, attr, _ in _projections(module):
        if hasattr(sub, attr + "_scale"):
            paths.append(path)
            modes.add(sub.input_scale_mode)
    if not paths:
        return None
    (mode,) = modes
    return {"quantized": paths, "input_scale_mode": mode}


def restore_layout(module, spec: dict | None) -> None:
    """Re-applies a ``layout`` to a freshly built (abstract) module."""
    if spec:
        _apply(module, spec["quantized"], spec["input_scale_mode"], "floor")


def convert(target, quantized: bool, qcfg: QuantConfig | None = None):
    """The same target with MXFP4 (``quantized=True``, quantized per ``qcfg`` if it is dense) or dense
    projections (False: MXFP4 weights dequantized to the target's dtype). Returns a new target."""
    module = target.module()
    if quantized and layout(module) is None:
        quantize_modules(module, qcfg or QuantConfig())
    elif not quantized:
        dequantize_modules(module, target.dtype)
    graphdef, params = nnx.split(module)
    return dataclasses.replace(target, graphdef=graphdef, params=params)


# ---------------------------------------------------------------------------------------------
# Writing Quark's layout


def _tensors(target, dtype) -> dict[str, np.ndarray]:
    """Checkpoint key -> host array (``layers.hf_tensors``: HF order): fused experts split into Quark's (and
    transformers') per-expert tensors; float tensors cast to ``dtype`` (each uncast copy dropped once cast),
    MXFP4 bytes kept."""
    out = {}
    for key, a in hf_tensors(target.cfg, target.params):
        if a.dtype != np.uint8:
            a = a.astype(dtype)
        m = re.fullmatch(r"(?P<group>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)(?P<scale>_scale)?", key)
        if m is None:
            out[key] = a
            continue
        suffix = "weight" + (m["scale"] or "")
        for e in range(a.shape[0]):
            if m["proj"] == "down_proj":
                out[f"{m['group']}.{e}.down_proj.{suffix}"] = a[e]
            else:  # gate rows first, then up rows (the checkpoint loader's stacking order)
                half = a.shape[1] // 2
                out[f"{m['group']}.{e}.gate_proj.{suffix}"] = a[e, :half]
                out[f"{m['group']}.{e}.up_proj.{suffix}"] = a[e, half:]
    return out


def _is_checkpoint(path: Path) -> bool:
    """What ``save_quark`` may replace: an earlier checkpoint (a folder of the user's it refuses)."""
    return (path / "config.json").is_file()


def save_quark(target, qcfg: QuantConfig, source, out, *, dtype=jnp.bfloat16, shard_bytes: int = 4 << 30) -> None:
    """Writes a quantized target (``convert(target, True, qcfg)``) as a Hugging Face checkpoint in
    AMD Quark's MXFP4 layout: config.json from ``source`` plus Quark's ``quantization_config``,
    safetensors (sharded with an index past ``shard_bytes``), and the other files of ``source``
    (tokenizer, generation config) copied. Dense tensors are written in ``dtype``.

    Projections left dense although ``qcfg`` does not exclude them (input width not a multiple of
    32) are added to the written ``exclude`` by name, so other engines read the same layout.
    """
    source, out = Path(source), Path(out)
    module = target.module()
    quantized = set(plan(module, qcfg))
    skipped = [n for path, _, _, names in _projections(module) if path not in quantized
               and not qcfg.excludes(names[0]) for n in names]
    state = layout(module)
    if state is None or set(state["quantized"]) != quantized:
        raise ValueError("save_quark: the target is not quantized per this QuantConfig; pass "
                         "quant.convert(target, True, qcfg)")
    raw, _ = read_config_json(source)
    raw["quantization_config"] = qcfg.to_hf(exclude=(*qcfg.exclude, *skipped))
    raw.pop("torch_dtype", None)
    raw["dtype"] = str(jnp.dtype(dtype))
    tensors = _tensors(target, jnp.dtype(dtype))
    shards, size = [[]], 0
    for key, a in tensors.items():
        if size and size + a.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += a.nbytes
    # Whole or nothing: an interrupted write leaves the previous ``out`` as it was.
    with atomic.directory_writer(out, replaces=_is_checkpoint, what="checkpoint", source=source) as tmp:
        (tmp / "config.json").write_text(json.dumps(raw, indent=2))
        for f in source.iterdir():
            if f.is_file() and f.name != "config.json" and not f.name.startswith("model"):
                shutil.copy(f, tmp / f.name)
        if len(shards) == 1:
            checkpoint.write_safetensors(tmp / "model.safetensors", tensors, {"format": "pt"})
            return
        weight_map = {}
        for i, keys in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            checkpoint.write_safetensors(tmp / name, {k: tensors[k] for k in keys}, {"format": "pt"})
            weight_map.update(dict.fromkeys(keys, name))
        total = sum(a.nbytes for a in tensors.values())
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


# ---------------------------------------------------------------------------------------------
# dflash-jax quantize


def quantize_checkpoint(model, out, *, exclude: tuple[str, ...] = (), input_scale_mode: str | None = None,
                        dtype=None, progress: bool = True) -> list[str]:
    """A dense Hugging Face checkpoint directory ``model`` -> an MXFP4 one at ``out`` in Quark's layout
    (readable by ``load_target`` and by other engines). Weights are quantized from their stored
    values (read as f32) with the OCP scale rule; ``exclude`` adds patterns to ``DEFAULT_EXCLUDE``;
    dense tensors are written in ``dtype`` (None: the checkpoint's own ``torch_dtype``/``dtype``,
    else bfloat16). Returns the weight paths quantized."""
    from dflash_jax.target import load_target  # target.py imports this module

    cfg_raw, source = read_config_json(model)
    # Refused now, not after the load and the quantization: the checks save_quark's write makes.
    atomic.check_replaceable(out, replaces=_is_checkpoint, what="checkpoint", source=model)
    if cfg_raw.get("quantization_config") is not None:
        raise ConfigError(f"{source}: quantization_config is already set; quantize reads a dense checkpoint")
    if dtype is None:
        stored = cfg_raw.get("torch_dtype") or cfg_raw.get("dtype")
        dtype = jnp.float32 if stored == "float32" else jnp.bfloat16
    qcfg = QuantConfig(exclude=(*DEFAULT_EXCLUDE, *exclude), input_scale_mode=input_scale_mode)
    target = convert(load_target(model, dtype=jnp.float32, kernels="reference", progress=progress), True, qcfg)
    quantized = layout(target.module())
    if quantized is None:
        raise ConfigError(f"quantize: nothing to quantize in {model}: every projection is excluded "
                          f"({', '.join(qcfg.exclude)}) or has an input width that is not a multiple of {BLOCK}")
    save_quark(target, qcfg, model, out, dtype=dtype)
    return quantized["quantized"]


def add_parser(sub) -> None:
    """Registers ``quantize`` on the ``dflash-jax`` subcommands."""
    q = sub.add_parser("quantize", help="write an MXFP4 copy of a target checkpoint in AMD Quark's layout")
    q.add_argument("--model", required=True, help="dense target checkpoint directory")
    q.add_argument("--out", required=True, help="output checkpoint directory")
    q.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                   help="module pattern that stays dense, added to " + ", ".join(DEFAULT_EXCLUDE)
                   + " (repeatable; glob, or 're:REGEX' as in Quark; e.g. '*.self_attn.*')")
    q.add_argument("--input-scale-mode", choices=SCALE_MODES, default=None,
                   help="also record dynamic MXFP4 activations (Quark's input_tensors) with this scale rule; "
                   "default: weight-only")
    q.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="dtype of the tensors left dense (default: the checkpoint's own, else bfloat16)")
    q.add_argument("--quiet", action="store_true", help="no loading progress bars")
    q.set_defaults(func=_cmd_quantize)


def _cmd_quantize(args) -> int:
    dtype = None if args.dtype is None else jnp.dtype(args.dtype)
    paths = quantize_checkpoint(args.model, args.out, exclude=tuple(args.exclude),
                                input_scale_mode=args.input_scale_mode, dtype=dtype, progress=not args.quiet)
    print(f"{len(paths)} projections MXFP4 -> {args.out}")
    return 0
