"""The training loop shared by every stage: jitted step, optax schedule, progress bar, resumable checkpoints.

Sits under ``lm.py``, ``drafter.py`` and ``mtp.py``: each gives a loss ``loss_fn(params, frozen, batch)
-> (loss, metrics)`` over its trainable params (a pytree) and a batch iterator; ``frozen`` is a pytree
the step reads but does not train (the frozen target), passed as an argument so it is not baked into
the compiled program. With more than one device the batch is sharded over a 1-D ``data`` mesh and
params are replicated; jit inserts the gradient all-reduce.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from dflash_jax.io import checkpoint


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int
    lr: float
    warmup: float = 0.04  # fraction of steps with a linear warmup (SpecForge's warmup ratio)
    weight_decay: float = 0.0
    clip: float = 1.0  # global gradient norm
    ckpt_every: int = 0  # 0: no checkpoints
    keep: int = 2  # checkpoints kept on disk
    log_every: int = 10
    stop_at: int = 0  # stop after this step (a run cut short, resumable later); 0: after ``steps``

    def __post_init__(self):
        """Settings that cannot train anything (or train NaNs) are refused before any work."""
        def need(ok: bool, msg: str):
            if not ok:
                raise ValueError(f"training settings: {msg}")

        for name in ("steps", "log_every", "keep"):
            value = getattr(self, name)
            need(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                 f"{name} must be an integer >= 1, got {value!r}")
        need(isinstance(self.stop_at, int) and not isinstance(self.stop_at, bool) and self.stop_at >= 0,
             f"stop_at must be an integer >= 0 (0: run every step), got {self.stop_at!r}")
        need(isinstance(self.ckpt_every, int) and self.ckpt_every >= 0,
             f"ckpt_every must be an integer >= 0 (0: no checkpoints), got {self.ckpt_every!r}")
        need(_finite(self.lr) and self.lr > 0, f"the learning rate must be a finite number > 0, got {self.lr!r}")
        need(_finite(self.warmup) and 0 <= self.warmup < 1, f"warmup must be a fraction in [0, 1), got {self.warmup!r}")
        need(_finite(self.weight_decay) and self.weight_decay >= 0,
             f"weight_decay must be a finite number >= 0, got {self.weight_decay!r}")
        need(_finite(self.clip) and self.clip > 0, f"clip must be a finite number > 0, got {self.clip!r}")


def _finite(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


class NonFiniteLoss(ValueError):
    """The loss or the gradients became NaN or Inf: the run stopped before saving anything of that step."""


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW on a warmup + cosine schedule (decaying to 10% of the peak), after global-norm clipping."""
    warmup = max(1, int(cfg.warmup * cfg.steps))
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, max(cfg.steps, warmup + 1), cfg.lr * 0.1)
    return optax.chain(optax.clip_by_global_norm(cfg.clip),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay))


def _ckpt_steps(ckpt_dir: Path) -> list[int]:
    if not ckpt_dir.is_dir():
        return []
    return sorted(int(m.group(1)) for p in ckpt_dir.iterdir() if (m := re.fullmatch(r"step_(\d+)", p.name)))


def _shardings(batch_example):
    """(params sharding, batch sharding) for a 1-D data mesh, or (None, None) on one device."""
    n = jax.device_count()
    if n == 1:
        return None, None
    if batch_example.shape[0] % n:
        raise ValueError(f"batch {batch_example.shape[0]} is not divisible by {n} devices")
    mesh = jax.make_mesh((n,), ("data",))
    return NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))


@functools.lru_cache(maxsize=16)
def _step_fn(loss_fn: Callable, cfg: TrainConfig):
    """The jitted optimizer step; cached so a resumed run in the same process reuses the compiled step."""
    opt = make_optimizer(cfg)

    @functools.partial(jax.jit, donate_argnums=0)  # the old state's buffers are reused for the new one
    def step_fn(state, frozen, batch):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], frozen, batch)
        updates, opt_state = opt.update(grads, state["opt"], state["params"])
        new = {"params": optax.apply_updates(state["params"], updates), "opt": opt_state, "step": state["step"] + 1}
        return new, dict(metrics, loss=loss, grad_norm=optax.global_norm(grads))

    return step_fn


@dataclasses.dataclass
class Result:
    params: object
    step: int
    history: list[dict]  # one entry per log interval: step, loss and the loss function's metrics
    seconds: float


def train(loss_fn: Callable, params, frozen, batches: Iterator, cfg: TrainConfig, *,
          ckpt_dir: str | Path | None = None, desc: str = "train", log_file: str | Path | None = None,
          meta: dict | None = None) -> Result:
    """Runs ``cfg.steps`` optimizer steps, resuming from the latest checkpoint in ``ckpt_dir`` if any.

    ``batches`` yields numpy pytrees whose leaves have the batch on axis 0; on resume the first
    ``step`` batches are skipped, so a deterministic iterator continues exactly where it stopped.
    Each log row is also appended to ``log_file`` (JSON lines) when given: progress of a background run.
    ``meta`` (JSON) is recorded in each checkpoint, and a checkpoint that does not record it is not resumed
    (``checkpoint.restore_params``): the layout of parameters whose shapes do not tell it.
    """
    opt = make_optimizer(cfg)
    params = jax.tree.map(jnp.copy, params)  # the step donates its state: keep the caller's arrays alive
    state = {"params": params, "opt": opt.init(params), "step": jnp.zeros((), jnp.int32)}
    ckpt_dir = None if ckpt_dir is None else Path(ckpt_dir)
    done = _ckpt_steps(ckpt_dir) if ckpt_dir is not None else []
    if done:
        state = checkpoint.restore_params(ckpt_dir / f"step_{done[-1]}", state, meta)
    start = int(state["step"])
    step_fn = _step_fn(loss_fn, cfg)
    for _ in range(start):
        next(batches)

    history, t0, first = [], time.time(), True
    end = min(cfg.stop_at or cfg.steps, cfg.steps)  # the schedule is the full run's either way
    bar = tqdm(range(start, end), desc=desc, initial=start, total=cfg.steps, mininterval=2.0)
    for step in bar:
        batch = next(batches)
        if first:
            replicated, sharded = _shardings(jax.tree.leaves(batch)[0])
            if replicated is not None:
                state, frozen = jax.device_put((state, frozen), replicated)
            first = False
        if sharded is not None:
            batch = jax.device_put(batch, sharded)
        state, metrics = step_fn(state, frozen, batch)
        loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):  # the update is then NaN: save nothing of it
            bar.close()
            kept = _ckpt_steps(ckpt_dir) if ckpt_dir is not None else []
            last = f"the last good checkpoint, {ckpt_dir / f'step_{kept[-1]}'}, is kept" if kept else \
                "no checkpoint was saved before it"
            raise NonFiniteLoss(f"{desc}: the loss became {loss} (gradient norm {grad_norm}) at step {step + 1}; "
                                f"training stopped and nothing of this step was saved ({last}). Lower the learning "
                                f"rate (it was {cfg.lr}), or check the data")
        if (step + 1) % cfg.log_every == 0 or step + 1 == end:
            row = {"step": step + 1, **{k: float(v) for k, v in metrics.items()}, "seconds": round(time.time() - t0, 1)}
            history.append(row)
            bar.set_postfix(loss=f"{row['loss']:.4f}")
            if log_file is not None:
                with open(log_file, "a") as f:
                    f.write(json.dumps(row) + "\n")
        if ckpt_dir is not None and cfg.ckpt_every and ((step + 1) % cfg.ckpt_every == 0 or step + 1 == end):
            checkpoint.save_params(ckpt_dir / f"step_{step + 1}", state, meta)
            for old in _ckpt_steps(ckpt_dir)[:-cfg.keep]:
                shutil.rmtree(ckpt_dir / f"step_{old}")
    bar.close()
    return Result(params=state["params"], step=int(state["step"]), history=history, seconds=time.time() - t0)


def evaluate(loss_fn: Callable, params, frozen, batches: list) -> float:
    """Mean loss over a fixed list of batches (no gradients)."""
    fn = jax.jit(lambda p, f, b: loss_fn(p, f, b)[0])
    return float(np.mean([float(fn(params, frozen, b)) for b in batches]))
