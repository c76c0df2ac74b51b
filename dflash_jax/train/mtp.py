"""Training Qwen3.5's MTP head on the frozen target: the baseline proposer DFlash is compared with.

Sits on ``loop.py`` and ``dflash_jax.decoding.mtp.mtp_step``. Same data and budget as the drafter: the
target's own greedy continuations (``drafter.regenerate``). Teacher forcing: entry t reads
(x_{t+1}, the target's final-normed h_t) and ``target.logits`` of its output is trained to predict
x_{t+2}, over whole sequences in one causal pass; labels in the prompt are masked out. Only ``mtp.*``
trains; the embedding and LM head it shares with the target stay frozen.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dflash_jax import kernels
from dflash_jax.decoding.mtp import mtp_step
from dflash_jax.decoding.proposers import TargetView
from dflash_jax.models.cache import position_table
from dflash_jax.models.target import Qwen35ForCausalLM, Target
from dflash_jax.train import loop
from dflash_jax.train.drafter import compute_taps

_IS_MTP = nnx.PathContains("mtp")


def mtp_loss_fn(graphdef, prompt_len: int):
    """loss(mtp params, target params without mtp (frozen), batch {tokens [B, L], hidden [B, L, D]})."""
    def loss_fn(mtp_params, rest, batch):
        tokens, hidden = batch["tokens"], batch["hidden"]
        model = nnx.merge(graphdef, mtp_params, jax.lax.stop_gradient(rest))
        B, L = tokens.shape
        cfg = model.cfg
        kc, vc = kernels.empty_cache(B, L - 1, cfg.num_key_value_heads, cfg.head_dim, hidden.dtype)
        view = TargetView.of(nnx.state(model))
        tab = position_table(cfg, L - 1)
        out, _, _ = mtp_step(model.mtp, view, tokens[:, 1:], hidden[:, :-1], kc, vc, jnp.zeros((B,), jnp.int32), tab)
        logits = model.logits(out[:, :-1]).astype(jnp.float32)  # entry t predicts x_{t+2}: [B, L-2, V]
        labels = tokens[:, 2:]
        keep = (jnp.arange(2, L) >= prompt_len).astype(jnp.float32)[None, :]  # only generated tokens
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        hit = (logits.argmax(-1) == labels).astype(jnp.float32)
        n = keep.sum() * B
        return (ce * keep).sum() / n, {"acc": (hit * keep).sum() / n}
    return loss_fn


def mtp_batches(seqs: np.ndarray, hidden: np.ndarray, *, batch: int, seed: int):
    rng = np.random.default_rng(seed)
    while True:
        rows = rng.integers(0, len(seqs), size=batch)
        yield {"tokens": seqs[rows], "hidden": hidden[rows]}


def train_mtp(target: Target, seqs: np.ndarray, prompt_len: int, tcfg: loop.TrainConfig, *, batch: int,
              seed: int = 0, ckpt_dir: str | Path | None = None,
              log_file: str | Path | None = None) -> tuple[Target, loop.Result]:
    """Trains a fresh MTP head for ``target`` (which has none); returns the target with its head."""
    model = Qwen35ForCausalLM(target.cfg, dtype=jnp.float32, mtp=True, rngs=nnx.Rngs(seed))
    graphdef, mtp_params, _ = nnx.split(model, _IS_MTP, ...)
    hidden = compute_taps(target, seqs, (), hidden=True)
    batches = mtp_batches(seqs, hidden, batch=batch, seed=seed + 1)
    res = loop.train(mtp_loss_fn(graphdef, prompt_len), mtp_params, target.params, batches, tcfg,
                     ckpt_dir=ckpt_dir, desc="mtp", log_file=log_file)
    full = nnx.state(nnx.merge(graphdef, res.params, target.params))
    return Target(target.cfg, nnx.graphdef(model), full), res
