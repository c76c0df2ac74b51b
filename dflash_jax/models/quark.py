"""Writing MXFP4 checkpoints in AMD Quark's layout: ``save_quark`` and the ``quantize_checkpoint`` job.

Sits on ``target.py`` (it loads the dense checkpoint) and ``quant.py`` (the MXFP4 weights in the model);
``dflash-jax quantize`` is its front end. The files it writes load with ``load_target`` and with other
engines that read Quark's exports (vLLM, SGLang).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from dflash_jax.config import DEFAULT_EXCLUDE, ConfigError, QuantConfig, read_config_json
from dflash_jax.io import atomic, checkpoint
from dflash_jax.kernels.mxfp4 import BLOCK
from dflash_jax.models.layers import hf_tensors
from dflash_jax.models.quant import convert, layout, plan, projections
from dflash_jax.models.target import load_target

# ---------------------------------------------------------------------------------------------
# Writing Quark's layout


def _tensors(target, dtype) -> dict[str, np.ndarray]:
    """Checkpoint key -> host array (``layers.hf_tensors``: HF order, an MXFP4 weight as its codes at ``<key>``
    and scales at ``<key>_scale``): fused experts split into Quark's (and transformers') per-expert tensors;
    float tensors cast to ``dtype`` (each uncast copy dropped once cast), MXFP4 bytes kept."""
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


WRITER = "dflash-jax quantize"  # the marker (``atomic.written_by``) of what save_quark may replace without overwrite


def save_quark(target, qcfg: QuantConfig, source, out, *, dtype=jnp.bfloat16, shard_bytes: int = 4 << 30,
               overwrite: bool = False) -> None:
    """Writes a quantized target (``convert(target, True, qcfg)``) as a Hugging Face checkpoint in
    AMD Quark's MXFP4 layout: config.json from ``source`` plus Quark's ``quantization_config``,
    safetensors (sharded with an index past ``shard_bytes``), and the other files of ``source``
    (tokenizer, generation config) copied. Dense tensors are written in ``dtype``.

    Projections left dense although ``qcfg`` does not exclude them (input width not a multiple of
    32) are added to the written ``exclude`` by name, so other engines read the same layout.

    ``out`` must be new, empty or an earlier output of this writer (``WRITER``'s marker) unless ``overwrite``;
    never ``source`` or a directory that holds it or lies in it (``atomic.check_replaceable``).
    """
    source, out = Path(source), Path(out)
    module = target.module()
    quantized = set(plan(module, qcfg))
    skipped = [n for path, _, _, names in projections(module) if path not in quantized
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
    with atomic.directory_writer(out, writer=WRITER, overwrite=overwrite, what="checkpoint", source=source) as tmp:
        (tmp / "config.json").write_text(json.dumps(raw, indent=2))
        for f in source.iterdir():
            if f.is_file() and f.name not in ("config.json", atomic.MARKER, atomic.MANIFEST) and not f.name.startswith(
                    "model"):
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
                        dtype=None, progress: bool = True, overwrite: bool = False) -> list[str]:
    """A dense Hugging Face checkpoint directory ``model`` -> an MXFP4 one at ``out`` in Quark's layout
    (readable by ``load_target`` and by other engines). Weights are quantized from their stored
    values (read as f32) with the OCP scale rule; ``exclude`` adds patterns to ``DEFAULT_EXCLUDE``;
    dense tensors are written in ``dtype`` (None: the checkpoint's own ``torch_dtype``/``dtype``,
    else bfloat16). ``out`` as ``save_quark`` takes it (checked first). Returns the weight paths quantized."""

    cfg_raw, source = read_config_json(model)
    # Refused now, not after the load and the quantization: the checks save_quark's write makes.
    atomic.check_replaceable(out, writer=WRITER, overwrite=overwrite, what="checkpoint", source=model)
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
    save_quark(target, qcfg, model, out, dtype=dtype, overwrite=overwrite)
    return quantized["quantized"]
