"""MXFP4 target weights: AMD Quark's checkpoint layout, quantized projections in the model, the writer.

Where it sits: between ``layers.py`` and ``target.py``. A projection holds MXFP4 weights when its weight
parameter (a ``Linear``'s ``weight``, the MoE experts' fused ``gate_up_proj`` / ``down_proj``) holds a
``layers.MXFP4Weight`` in place of the dense array: this module swaps the parameter's value and nothing
else, so the parameter keeps its logical axes (``parallel.param``) and the module its attributes; ``Linear``
and ``Experts`` dispatch on the value's type and compute through ``dflash_jax/kernels/mxfp4.py`` (the Pallas kernels on
a GPU, a dequantizing reference elsewhere). ``load_target`` asks this module which projections a checkpoint
stores quantized (``quantize_modules`` on the abstract model) and converts between bf16 and MXFP4 at load
time (``convert``); ``save_quark`` writes a quantized target back in Quark's layout. The drafter never comes
here: it stays bf16.

The format (``dflash_jax/kernels/mxfp4.py``): e2m1 codes two per byte, the even-index element in the low nibble; one
e8m0 scale byte s per 32 consecutive inputs, value 2^(s - 127). Checkpoint keys (``checkpoint.tensor_keys``)
are Quark's: ``<module>.weight`` uint8 codes [out, in/2] + ``<module>.weight_scale`` uint8 [out, in/32]; the
fused MoE experts store ``experts.gate_up_proj`` [E, 2I, D/2] + ``experts.gate_up_proj_scale`` [E, 2I, D/32]
(``down_proj`` likewise), which the checkpoint loader stacks from Quark's per-expert
``experts.{e}.{gate,up,down}_proj.weight(_scale)`` tensors.
"""

from __future__ import annotations

import dataclasses

from flax import nnx

from dflash_jax.config import ConfigError, QuantConfig
from dflash_jax.kernels.mxfp4 import BLOCK
from dflash_jax.models.layers import Experts, Linear, MXFP4Weight

__all__ = ["convert", "dequantize_modules", "layout", "plan", "projections", "quantize_modules", "restore_layout"]

# ---------------------------------------------------------------------------------------------
# The model's projections


def projections(module):
    """(weight path, owning module, attribute, per-expert module names or None) of every projection
    MXFP4 can hold: each ``Linear``'s weight and each ``Experts``' two fused weights."""
    for path, sub in nnx.iter_graph(module):
        name = ".".join(map(str, path))
        if isinstance(sub, Linear):
            yield f"{name}.weight", sub, "weight", [name]
        elif isinstance(sub, Experts):
            E = sub.down_proj.shape[0]
            yield (f"{name}.gate_up_proj", sub, "gate_up_proj",
                   [f"{name}.{e}.{p}" for e in range(E) for p in ("gate_proj", "up_proj")])
            yield f"{name}.down_proj", sub, "down_proj", [f"{name}.{e}.down_proj" for e in range(E)]


def plan(module, qcfg: QuantConfig) -> list[str]:
    """Weight paths ``qcfg`` quantizes in ``module``: every projection not excluded whose input width
    is a multiple of 32 (others cannot be blocked and stay bf16)."""
    out = []
    for path, sub, attr, names in projections(module):
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
        if getattr(sub, attr).shape[-1] % BLOCK == 0:  # the input width, dense or MXFP4 (``MXFP4Weight.shape``)
            out.append(path)
    return out


def _apply(module, paths, input_scale_mode: str | None, scale_mode: str) -> None:
    """Replaces the value of each weight parameter in ``paths`` by its ``MXFP4Weight``: shapes only on an
    abstract module (``nnx.eval_shape``), quantized values on a concrete one. ``var.replace`` keeps the
    parameter's metadata (its logical axes), so codes and scales shard along the weight's axes."""
    todo = set(paths)
    for path, sub, attr, _ in projections(module):
        if path in todo:
            todo.discard(path)
            var = getattr(sub, attr)
            setattr(sub, attr, var.replace(MXFP4Weight.quantize(var.get_value(), scale_mode, input_scale_mode)))
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
    for path, sub, attr, _ in projections(module):
        var = getattr(sub, attr)
        if isinstance(w := var.get_value(), MXFP4Weight):
            setattr(sub, attr, var.replace(w.dequantize(dtype)))  # keeps its logical axes
            done.append(path)
    return done


def layout(module) -> dict | None:
    """The MXFP4 layout of ``module`` as JSON (for converted copies), None when nothing is quantized."""
    quantized = {path: w for path, sub, attr, _ in projections(module)
                 if isinstance(w := getattr(sub, attr).get_value(), MXFP4Weight)}
    if not quantized:
        return None
    (mode,) = {w.input_scale_mode for w in quantized.values()}
    return {"quantized": list(quantized), "input_scale_mode": mode}


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
