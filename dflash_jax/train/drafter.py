"""Training the DFlash drafter (the DFlash paper's recipe) on a frozen target's own greedy continuations.

Sits on ``loop.py``, the drafter modules of ``dflash_jax.models.drafter`` and the frozen target. The recipe:
the target regenerates corpus snippets (``regenerate``); its taps over each whole sequence are
computed once (the target is frozen). Per sequence, ``anchors`` distinct positions p are drawn from
the generated region; block p is ``[x_p, MASK x (B-1)]`` at positions p..p+B-1 and offset k predicts
x_{p+k} (same-position labels, k >= 1). All blocks of a sequence run in one forward
(``block_hidden``): the decoder's own ``write_context`` + ``draft_block``, batched over anchors, so a
block sees the context strictly before its anchor and itself (bidirectionally; causally in sliding
layers), nothing of other blocks, exactly as at inference. The loss is CE weighted by
exp(-(k-1)/gamma), normalised by the weights' sum. The drafter shares the target's embedding and LM
head, which stay frozen. A DFlash2 drafter trains its convolutions inside the same forward, and its
candidate selector with a second CE of the same weights over every token's score (logit + the pair term),
teacher-forced: offset k's predecessor is the true token at k - 1 (the selector's walk follows its own
choices at inference; where the drafts are right, those are the same tokens).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.decoding.api import generate
from dflash_jax.models.drafter import (
    DFlashDrafter,
    Drafter,
    draft_block,
    draft_logits,
    init_draft_cache,
    init_drafter,
    write_context,
)
from dflash_jax.models.layers import with_kernels
from dflash_jax.models.target import Target, forward
from dflash_jax.train import loop

ARCHS = ("dflash", "dflash2")
DFLASH2 = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=256, selector_top_k=16)
# Decay of the loss weights over block offsets, by block size (the DFlash paper: 7 for 16, 5 for 10, 4 for 8).
GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def drafter_config(target_cfg: TargetConfig, *, num_layers: int, taps: tuple[int, ...], mask_token_id: int,
                   block_size: int = 16, heads: int = 4, kv_heads: int = 2, head_dim: int = 64,
                   intermediate: int = 768, arch: str = "dflash") -> DrafterConfig:
    """A drafter for ``target_cfg``: same width and vocabulary, full-attention Qwen3 layers. ``arch`` "dflash2"
    adds DFlash2's convolutions and candidate selector with the released Qwen3.8-27B-DFlash2 settings
    (``DFLASH2``: conv kernel 2, groups of 16 channels, selector rank 256, top-16 candidates)."""
    if arch not in ARCHS:
        raise ValueError(f"drafter arch must be one of {ARCHS}, got {arch!r}")
    return DrafterConfig(
        hidden_size=target_cfg.hidden_size, num_hidden_layers=num_layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=intermediate,
        vocab_size=target_cfg.vocab_size, block_size=block_size, mask_token_id=mask_token_id,
        target_layer_ids=taps, num_target_layers=target_cfg.num_hidden_layers, rms_norm_eps=target_cfg.rms_norm_eps,
        **(DFLASH2 if arch == "dflash2" else {}))


def loss_weights(block_size: int, gamma: float | None = None) -> np.ndarray:
    """[block_size] weight of each block offset: 0 for the anchor, exp(-(k-1)/gamma) for k >= 1."""
    gamma = GAMMA.get(block_size, 7.0) if gamma is None else gamma
    k = np.arange(block_size)
    return np.where(k >= 1, np.exp(-(k - 1) / gamma), 0.0).astype(np.float32)


def check_data(seq_len: int, prompt_len: int, block_size: int, anchors: int) -> None:
    """Refuses, before any work, data settings that leave no training block: ``anchors`` distinct anchor
    positions must fit in [prompt_len - 1, seq_len - block_size] (see ``anchor_batches``)."""
    for name, value, low in (("prompt length", prompt_len, 1), ("block size", block_size, 2), ("anchors", anchors, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"training settings: the {name} must be an integer >= {low}, got {value!r}")
    room = seq_len - block_size - prompt_len + 2
    if room < anchors:
        raise ValueError(f"training settings: sequences of {seq_len} tokens with a {prompt_len}-token prompt leave "
                         f"{max(room, 0)} anchor positions for blocks of {block_size}, fewer than {anchors} anchors "
                         f"per sequence: lengthen the sequence or use fewer anchors or a smaller block")


def regenerate(target: Target, prompts: np.ndarray, new_tokens: int, *, batch: int,
               progress: bool = True) -> np.ndarray:
    """The target's greedy continuations: [N, P + new_tokens] = prompt ++ generated (no stop ids)."""
    rows = []
    with tqdm(total=len(prompts), unit="seq", disable=not progress, mininterval=1.0,
              desc=f"data: the target continues {len(prompts)} snippets by {new_tokens} tokens") as bar:
        for i in range(0, len(prompts), batch):
            chunk = prompts[i:i + batch]
            if i == 0:
                bar.set_postfix_str("compiling")
            out = generate(target, [list(p) for p in chunk], block_size=1, max_new_tokens=new_tokens, stop_ids=())
            rows.append(np.concatenate([chunk, np.asarray(out.tokens)], axis=1))
            bar.set_postfix_str("")
            bar.update(len(chunk))
    return np.concatenate(rows).astype(np.int32)


def compute_features(target: Target, seqs: np.ndarray, taps: tuple[int, ...], *, batch: int = 16,
                     progress: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Frozen target features of whole sequences [N, L], one forward each: the drafter's taps [N, L, n*D] and
    the final-normed hidden states [N, L, D] the MTP head reads."""
    fn = jax.jit(lambda p, x: (lambda o: (o.taps, o.hidden))(forward(target.graphdef, p, x, taps=taps)))
    out = []
    with tqdm(total=len(seqs), unit="seq", disable=not progress, mininterval=1.0,
              desc=f"data: the target's layers {list(taps)} and hidden states per sequence") as bar:
        for i in range(0, len(seqs), batch):
            out.append(jax.device_get(fn(target.params, jnp.asarray(seqs[i:i + batch]))))
            bar.update(len(out[-1][0]))
    return np.concatenate([t for t, _ in out]), np.concatenate([h for _, h in out])


def block_hidden(drafter: DFlashDrafter, taps: jax.Array, x: jax.Array, anchors: jax.Array) -> jax.Array:
    """The training forward: every block of every sequence, through the decoder's own ``draft_block``.

    The whole sequence's context K/V is written once; each anchor then sees it as a cache whose
    committed length is the anchor (its block's K/V overwrite the rows from there on), so block n
    attends to the context strictly before anchors[n] and to itself, nothing of other blocks. The
    attention runs in the plain-jnp ``reference`` mode (differentiable, the Pallas kernels are not).

    Args:
      taps: [B, S, n*Dt] target features of the whole sequence (positions 0..S-1).
      x: [B, N, Bk, D] target embeddings of each block ``[x_anchor, MASK ...]``.
      anchors: [B, N] int32 anchor positions (block n sits at anchors[n] + 0..Bk-1).
    Returns:
      [B, N, Bk, D] final-normed drafter states (for the target's LM head).
    """
    drafter = with_kernels(drafter, "reference")
    B, S = taps.shape[:2]
    # Room for a block that runs past the sequence's end, so no write is clipped.
    cache = init_draft_cache(drafter.cfg, B, S + x.shape[2], drafter.fc.weight.dtype)
    cache = write_context(drafter, cache, taps)

    def one(anchor, block):  # anchor [B], block [B, Bk, D] -> [B, Bk, D]
        return draft_block(drafter, dataclasses.replace(cache, lengths=anchor), block)[0]

    return jax.vmap(one, in_axes=(1, 1), out_axes=1)(anchors, x)


def drafter_loss_fn(drafter_graphdef, target_graphdef, cfg: DrafterConfig, gamma: float | None = None,
                    distil_temperature: float | None = None):
    """loss(drafter params, target params (frozen), batch) for batches from ``anchor_batches``.

    ``distil_temperature`` T: instead of CE on the sequence's tokens, KL(p_T || q_T) at every offset, p_T the
    target's distribution of that token at temperature T (from ``batch["hidden"]`` [B, L, D], the target's
    final-normed states: the token at position i is predicted at i - 1) and q_T the drafter's: the
    distribution sampled drafts accept with (Σ min(p, q) = 1 - TV(p, q)), not only its argmax."""
    weights = jnp.asarray(loss_weights(cfg.block_size, gamma))  # [Bk]

    def loss_fn(params, target_params, batch):
        tokens, taps, anchors = batch["tokens"], batch["taps"], batch["anchors"]  # [B, L], [B, L, nD], [B, N]
        target = nnx.merge(target_graphdef, jax.lax.stop_gradient(target_params))
        Bk = cfg.block_size
        idx = anchors[:, :, None] + jnp.arange(Bk)  # [B, N, Bk] label positions (offset 0: the anchor)
        labels = jnp.take_along_axis(tokens[:, None, :], idx.reshape(idx.shape[0], 1, -1), axis=2).reshape(idx.shape)
        block = jnp.where(jnp.arange(Bk) == 0, labels, cfg.mask_token_id)  # [anchor, MASK, ...]
        drafter = nnx.merge(drafter_graphdef, params)
        hidden = block_hidden(drafter, taps, target.model.embed_tokens(block), anchors)
        logits = draft_logits(cfg, target.logits(hidden)).astype(jnp.float32)  # [B, N, Bk, V]
        if distil_temperature is None:
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        else:  # the target's logits of each label, [B, N, Bk, V]; offset 0 (weight 0) reads the anchor's own state
            prev = jnp.take_along_axis(batch["hidden"][:, None], jnp.maximum(idx - 1, 0)[..., None], axis=2)
            p_log = jax.nn.log_softmax(target.logits(prev).astype(jnp.float32) / distil_temperature, axis=-1)
            q_log = jax.nn.log_softmax(logits / distil_temperature, axis=-1)
            ce = (jnp.exp(p_log) * (p_log - q_log)).sum(-1)  # KL(p_T || q_T)
        w = jnp.broadcast_to(weights, ce.shape)
        hit = (logits.argmax(-1) == labels)
        metrics = {"acc": hit[..., 1:].mean(), "acc1": hit[..., 1].mean()}
        loss = (ce * w).sum() / w.sum()
        if cfg.dflash2:  # the candidate selector, teacher-forced: offset k's predecessor is the label at k - 1
            pred = jnp.concatenate([labels[..., :1], labels[..., :-1]], axis=-1)  # offset 1's is the anchor
            scores = drafter.candidate_selector.full_scores(hidden, logits, pred)  # [B, N, Bk, V]
            selector_ce = optax.softmax_cross_entropy_with_integer_labels(scores, labels)
            loss = loss + (selector_ce * w).sum() / w.sum()
            metrics["selector_acc"] = (scores.argmax(-1) == labels)[..., 1:].mean()
        return loss, metrics

    return loss_fn


def anchor_batches(seqs: np.ndarray, taps: np.ndarray, prompt_len: int, *, block: int, anchors: int, batch: int,
                   seed: int, hidden: np.ndarray | None = None) -> Iterator[dict]:
    """Endless seeded batches: sequences drawn at random, ``anchors`` distinct sorted anchors each
    (with ``hidden`` [N, L, D], the target's final-normed states, for distillation).

    Anchors p lie in [prompt_len - 1, L - block]: every label p+1..p+block-1 is a generated token and
    in bounds (the last prompt token is the first anchor decoding ever sees).
    """
    L = seqs.shape[1]
    lo, hi = prompt_len - 1, L - block
    if hi - lo + 1 < anchors:
        raise ValueError(f"only {hi - lo + 1} anchor positions in [{lo}, {hi}] for {anchors} anchors per sequence")
    rng = np.random.default_rng(seed)
    while True:
        rows = rng.integers(0, len(seqs), size=batch)
        a = np.stack([np.sort(rng.choice(np.arange(lo, hi + 1), anchors, replace=False)) for _ in rows])
        extra = {} if hidden is None else {"hidden": hidden[rows]}
        yield {"tokens": seqs[rows], "taps": taps[rows], "anchors": a.astype(np.int32), **extra}


def train_drafter(target: Target, cfg: DrafterConfig, seqs: np.ndarray, prompt_len: int, tcfg: loop.TrainConfig,
                  *, anchors: int, batch: int, seed: int = 0, ckpt_dir: str | Path | None = None,
                  log_file: str | Path | None = None, taps: np.ndarray | None = None,
                  hidden: np.ndarray | None = None, distil_temperature: float | None = None,
                  init: Drafter | None = None) -> tuple[Drafter, loop.Result]:
    """Trains a drafter (fresh, or from ``init``) on target-regenerated sequences [N, L] (the first prompt_len
    are the prompt); ``taps`` [N, L, n*D] and ``hidden`` [N, L, D]: the target's features of them
    (``compute_features``), computed here if None; ``distil_temperature``: see ``drafter_loss_fn``."""
    check_data(seqs.shape[1], prompt_len, cfg.block_size, anchors)
    drafter = init_drafter(cfg, dtype=jnp.float32, seed=seed) if init is None else init
    if taps is None or (distil_temperature is not None and hidden is None):
        taps, hidden = compute_features(target, seqs, cfg.target_layer_ids)
    batches = anchor_batches(seqs, taps, prompt_len, block=cfg.block_size, anchors=anchors, batch=batch,
                             seed=seed + 1, hidden=None if distil_temperature is None else hidden)
    loss_fn = drafter_loss_fn(drafter.graphdef, target.graphdef, cfg, distil_temperature=distil_temperature)
    res = loop.train(loss_fn, drafter.params, target.params, batches, tcfg, ckpt_dir=ckpt_dir, desc="drafter",
                     log_file=log_file)
    return Drafter(cfg, drafter.graphdef, res.params), res

