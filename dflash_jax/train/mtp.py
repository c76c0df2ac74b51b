"""Training Qwen3.5's MTP head on the frozen target: the baseline proposer DFlash is compared with.

Sits on ``loop.py`` and ``dflash_jax.decoding.mtp.mtp_step``. Same data and budget as the drafter: the
target's own greedy continuations (``drafter.regenerate``). Trained the way it drafts: step 1 teacher-forced
(entry t reads x_{t+1} and the target's final-normed h_t, and predicts x_{t+2}) over whole sequences in one
causal pass, then steps 2 .. unroll fed the head's own output, one position further each (``mtp_loss_fn``),
so its acceptance keeps growing with depth; labels in the prompt are masked out. Only ``mtp.*`` trains; the
embedding and LM head it shares with the target stay frozen.
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
from dflash_jax.train.drafter import compute_features

_IS_MTP = nnx.PathContains("mtp")


def mtp_loss_fn(graphdef, prompt_len: int, unroll: int):
    """loss(mtp params, target params without mtp (frozen), batch {tokens [B, L], hidden [B, L, D], anchors [B, N]}).

    Step 1 is teacher-forced over every position: entry t reads (x_{t+1}, h_t) and predicts x_{t+2}. Steps
    k = 2 .. ``unroll`` run as ``MTPProposer.propose`` drafts, for the chains of ``anchors`` t: the head's
    cache holds the step-1 entries 0 .. t, and step k writes and reads one entry at position t + k - 1 that
    pairs x_{t+k} (the target's token, which an accepted draft equals) with the head's own output of step
    k - 1, predicting x_{t+k+1}. The loss is the mean over steps of each step's mean CE; gradients flow
    through the whole chain.
    """
    def loss_fn(mtp_params, rest, batch):
        tokens, hidden, anchors = batch["tokens"], batch["hidden"], batch["anchors"]
        model = nnx.merge(graphdef, mtp_params, jax.lax.stop_gradient(rest))
        B, L = tokens.shape
        cfg = model.cfg
        S = L + unroll  # room for every chain's entries past the sequence's last step-1 entry
        kc, vc = kernels.empty_cache(B, S, cfg.num_key_value_heads, cfg.head_dim, hidden.dtype)
        view = TargetView.of(nnx.state(model))
        tab = position_table(cfg, S)
        out, kc, vc = mtp_step(model.mtp, view, tokens[:, 1:], hidden[:, :-1], kc, vc, jnp.zeros((B,), jnp.int32),
                               tab)  # [B, L-1, D]
        logits = model.logits(out[:, :-1]).astype(jnp.float32)  # entry t predicts x_{t+2}: [B, L-2, V]
        labels = tokens[:, 2:]
        keep = (jnp.arange(2, L) >= prompt_len).astype(jnp.float32)[None, :]  # only generated tokens
        n = keep.sum() * B
        ce = [(optax.softmax_cross_entropy_with_integer_labels(logits, labels) * keep).sum() / n]
        hits = [((logits.argmax(-1) == labels) * keep).sum() / n]

        def chain(anchor):  # anchor [B] -> the head's outputs of steps 2 .. unroll [B, unroll - 1, D]
            h = jnp.take_along_axis(out, anchor[:, None, None], axis=1)  # [B, 1, D] step 1's output at t
            k_cache, v_cache, outs = kc, vc, []
            for k in range(2, unroll + 1):  # entries of rows > t + k - 1 are never read: writes come first
                tok = jnp.take_along_axis(tokens, (anchor + k)[:, None], axis=1)  # [B, 1] x_{t+k}
                h, k_cache, v_cache = mtp_step(model.mtp, view, tok, h, k_cache, v_cache, anchor + k - 1, tab)
                outs.append(h[:, 0])
            return jnp.stack(outs, axis=1)

        if unroll > 1:
            deep = jax.vmap(chain, in_axes=1, out_axes=1)(anchors)  # [B, N, unroll - 1, D]
            idx = anchors[:, :, None] + jnp.arange(3, unroll + 2)  # [B, N, unroll - 1]: x_{t+k+1}
            deep_labels = jnp.take_along_axis(tokens, idx.reshape(B, -1), axis=1).reshape(idx.shape)
            deep_logits = model.logits(deep).astype(jnp.float32)
            ce += list(optax.softmax_cross_entropy_with_integer_labels(deep_logits, deep_labels).mean(axis=(0, 1)))
            hits += list((deep_logits.argmax(-1) == deep_labels).mean(axis=(0, 1)))
        return sum(ce) / len(ce), {f"acc{k + 1}": h for k, h in enumerate(hits)}
    return loss_fn


def check_data(seq_len: int, prompt_len: int, unroll: int, anchors: int) -> tuple[int, int]:
    """The first and last chain anchor, [prompt_len - 1, seq_len - unroll - 2]; refuses, before any work,
    settings that leave fewer than ``anchors`` positions or train no step."""
    for name, value in (("unroll", unroll), ("anchors", anchors)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"training settings: {name} must be an integer >= 1, got {value!r}")
    lo, hi = prompt_len - 1, seq_len - unroll - 2
    if hi - lo + 1 < anchors:
        raise ValueError(f"training settings: sequences of {seq_len} tokens with a {prompt_len}-token prompt leave "
                         f"{max(hi - lo + 1, 0)} chain anchors for {unroll} unrolled steps, fewer than {anchors} "
                         "per sequence: lengthen the sequence or use fewer anchors or a shorter unroll")
    return lo, hi


def mtp_batches(seqs: np.ndarray, hidden: np.ndarray, prompt_len: int, *, batch: int, unroll: int, anchors: int,
                seed: int):
    """Endless seeded batches: random sequences and ``anchors`` distinct chain anchors t each, in
    [prompt_len - 1, L - unroll - 2] (the first is where decoding's first draft starts; the last keeps
    every label in bounds)."""
    lo, hi = check_data(seqs.shape[1], prompt_len, unroll, anchors)
    rng = np.random.default_rng(seed)
    while True:
        rows = np.sort(rng.integers(0, len(seqs), size=batch))
        a = np.stack([np.sort(rng.choice(np.arange(lo, hi + 1), anchors, replace=False)) for _ in rows])
        yield {"tokens": seqs[rows], "hidden": np.asarray(hidden[rows]), "anchors": a.astype(np.int32)}


def train_mtp(target: Target, seqs: np.ndarray, prompt_len: int, tcfg: loop.TrainConfig, *, batch: int,
              unroll: int = 1, anchors: int = 16, seed: int = 0, ckpt_dir: str | Path | None = None,
              log_file: str | Path | None = None, hidden: np.ndarray | None = None) -> tuple[Target, loop.Result]:
    """Trains a fresh MTP head for ``target`` (which has none) over ``unroll`` steps (``mtp_loss_fn``); returns
    the target with its head. ``hidden`` [N, L, D]: the target's final-normed states of ``seqs``
    (``drafter.compute_features``), computed here if None."""
    model = Qwen35ForCausalLM(target.cfg, dtype=jnp.float32, mtp=True, rngs=nnx.Rngs(seed))
    graphdef, mtp_params, _ = nnx.split(model, _IS_MTP, ...)
    if hidden is None:
        hidden = compute_features(target, seqs, ())[1]
    batches = mtp_batches(seqs, hidden, prompt_len, batch=batch, unroll=unroll, anchors=anchors, seed=seed + 1)
    res = loop.train(mtp_loss_fn(graphdef, prompt_len, unroll), mtp_params, target.params, batches, tcfg,
                     ckpt_dir=ckpt_dir, desc="mtp", log_file=log_file)
    full = nnx.state(nnx.merge(graphdef, res.params, target.params))
    return Target(target.cfg, nnx.graphdef(model), full), res
