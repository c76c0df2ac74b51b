"""Training the DFlash drafter (reference/dflash.md §6) on a frozen target's own greedy continuations.

Sits on ``loop.py``, the drafter modules of ``dflash_jax.drafter`` and the frozen target. The recipe:
the target regenerates corpus snippets (``regenerate``); its taps over each whole sequence are
computed once (the target is frozen). Per sequence, ``anchors`` distinct positions p are drawn from
the generated region; block p is ``[x_p, MASK x (B-1)]`` at positions p..p+B-1 and offset k predicts
x_{p+k} (same-position labels, k >= 1). All blocks of a sequence run in one forward
(``block_hidden``) over ``[context K/V ; blocks]`` with a dense mask: a block sees the context
strictly before its anchor and itself (bidirectionally; causally in sliding layers), nothing of other
blocks. The loss is CE weighted by exp(-(k-1)/gamma), normalised by the weights' sum. The drafter
shares the target's embedding and LM head, which stay frozen.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dflash_jax.config import TargetConfig
from dflash_jax.drafter import DFlashDrafter, Drafter, DrafterConfig, draft_logits, init_drafter
from dflash_jax.rope import rope
from dflash_jax.speculative import generate
from dflash_jax.target import Target, forward
from dflash_jax.train import loop

# Decay of the loss weights over block offsets, by block size (dflash.md §6: 7 for 16, 5 for 10, 4 for 8).
GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def drafter_config(target_cfg: TargetConfig, *, num_layers: int, taps: tuple[int, ...], mask_token_id: int,
                   block_size: int = 16, heads: int = 4, kv_heads: int = 2, head_dim: int = 64,
                   intermediate: int = 768) -> DrafterConfig:
    """A drafter for ``target_cfg``: same width and vocabulary, full-attention Qwen3 layers."""
    return DrafterConfig(
        hidden_size=target_cfg.hidden_size, num_hidden_layers=num_layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=intermediate,
        vocab_size=target_cfg.vocab_size, block_size=block_size, mask_token_id=mask_token_id,
        target_layer_ids=taps, num_target_layers=target_cfg.num_hidden_layers, rms_norm_eps=target_cfg.rms_norm_eps)


def loss_weights(block_size: int, gamma: float | None = None) -> np.ndarray:
    """[block_size] weight of each block offset: 0 for the anchor, exp(-(k-1)/gamma) for k >= 1."""
    gamma = GAMMA.get(block_size, 7.0) if gamma is None else gamma
    k = np.arange(block_size)
    return np.where(k >= 1, np.exp(-(k - 1) / gamma), 0.0).astype(np.float32)


def regenerate(target: Target, prompts: np.ndarray, new_tokens: int, *, batch: int) -> np.ndarray:
    """The target's greedy continuations: [N, P + new_tokens] = prompt ++ generated (no stop ids)."""
    rows = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        out = generate(target, [list(p) for p in chunk], block_size=1, max_new_tokens=new_tokens, stop_ids=())
        rows.append(np.concatenate([chunk, np.asarray(out.tokens)], axis=1))
    return np.concatenate(rows).astype(np.int32)


def compute_taps(target: Target, seqs: np.ndarray, taps: tuple[int, ...], *, batch: int = 16,
                 hidden: bool = False) -> np.ndarray:
    """Frozen target features of whole sequences: taps [N, L, n*D] (or final-normed hidden [N, L, D])."""
    fn = jax.jit(lambda p, x: (lambda o: o.hidden if hidden else o.taps)(forward(target.graphdef, p, x, taps=taps)))
    return np.concatenate([np.asarray(fn(target.params, jnp.asarray(seqs[i:i + batch])))
                           for i in range(0, len(seqs), batch)])


def _attend(q, k, v, mask):
    """Dense GQA attention. q [B, Q, N, H]; k, v [B, S, K, H]; mask [B, Q, S] bool -> [B, Q, N, H]."""
    B, Q, N, H = q.shape
    K = k.shape[2]
    qg = q.reshape(B, Q, K, N // K, H)
    s = jnp.einsum("bqkgh,bskh->bkgqs", qg, k, preferred_element_type=jnp.float32) * H**-0.5
    s = jnp.where(mask[:, None, None], s, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgqs,bskh->bqkgh", p, v).reshape(B, Q, N, H)


def block_mask(anchors: jax.Array, S: int, block: int, *, causal: bool, window: int | None) -> jax.Array:
    """[B, N*Bk, S + N*Bk] bool: block n sees context kv < anchor_n and its own block (causal if asked)."""
    B, N = anchors.shape
    qpos = (anchors[:, :, None] + jnp.arange(block)).reshape(B, N * block)  # [B, Q] absolute positions
    qblk = jnp.repeat(jnp.arange(N), block)  # [Q] block of each query
    qoff = jnp.tile(jnp.arange(block), N)  # [Q] offset inside the block
    ctx = jnp.arange(S)[None, None, :] < jnp.repeat(anchors, block, axis=1)[:, :, None]  # [B, Q, S]
    own = qblk[:, None] == qblk[None, :]  # [Q, Q]
    if causal:
        own = own & (qoff[None, :] <= qoff[:, None])
    mask = jnp.concatenate([ctx, jnp.broadcast_to(own, (B,) + own.shape)], axis=-1)
    if window is not None:
        kpos = jnp.concatenate([jnp.broadcast_to(jnp.arange(S), (B, S)), qpos], axis=1)  # [B, S + Q]
        mask = mask & (kpos[:, None, :] > qpos[:, :, None] - window)
    return mask


def block_hidden(drafter: DFlashDrafter, taps: jax.Array, x: jax.Array, anchors: jax.Array) -> jax.Array:
    """The training forward: every block of every sequence in one pass.

    Args:
      taps: [B, S, n*Dt] target features of the whole sequence (positions 0..S-1).
      x: [B, N, Bk, D] target embeddings of each block ``[x_anchor, MASK ...]``.
      anchors: [B, N] int32 anchor positions (block n sits at anchors[n] + 0..Bk-1).
    Returns:
      [B, N, Bk, D] final-normed drafter states (for the target's LM head).
    """
    cfg = drafter.cfg
    B, N, Bk, D = x.shape
    S, Nh, H = taps.shape[1], cfg.num_attention_heads, cfg.head_dim
    dtype = drafter.fc.weight.dtype
    c = drafter.hidden_norm(drafter.fc(taps.astype(dtype)))  # [B, S, D]: injected into every layer's K/V
    ctx_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    pos = (anchors[:, :, None] + jnp.arange(Bk, dtype=jnp.int32)).reshape(B, N * Bk)  # [B, Q]
    h = x.reshape(B, N * Bk, D).astype(dtype)
    for i, layer in enumerate(drafter.layers):
        attn = layer.self_attn
        a = layer.input_layernorm(h)
        q = rope(attn.q_norm(attn.q_proj(a).reshape(B, N * Bk, Nh, H)), pos, theta=cfg.rope_theta, rotary_dim=H,
                 scaling=cfg.rope_scaling)
        kc, vc = attn.kv(c, ctx_pos)
        kb, vb = attn.kv(a, pos)
        mask = block_mask(anchors, S, Bk, causal=cfg.layer_causal(i), window=cfg.layer_window(i))
        o = _attend(q, jnp.concatenate([kc, kb], 1), jnp.concatenate([vc, vb], 1), mask)
        h = h + attn.o_proj(o.reshape(B, N * Bk, Nh * H))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return drafter.norm(h).reshape(B, N, Bk, D)


def drafter_loss_fn(drafter_graphdef, target_graphdef, cfg: DrafterConfig, gamma: float | None = None):
    """loss(drafter params, target params (frozen), batch) for batches from ``anchor_batches``."""
    weights = jnp.asarray(loss_weights(cfg.block_size, gamma))  # [Bk]

    def loss_fn(params, target_params, batch):
        tokens, taps, anchors = batch["tokens"], batch["taps"], batch["anchors"]  # [B, L], [B, L, nD], [B, N]
        target = nnx.merge(target_graphdef, jax.lax.stop_gradient(target_params))
        Bk = cfg.block_size
        idx = anchors[:, :, None] + jnp.arange(Bk)  # [B, N, Bk] label positions (offset 0: the anchor)
        labels = jnp.take_along_axis(tokens[:, None, :], idx.reshape(idx.shape[0], 1, -1), axis=2).reshape(idx.shape)
        block = jnp.where(jnp.arange(Bk) == 0, labels, cfg.mask_token_id)  # [anchor, MASK, ...]
        hidden = block_hidden(nnx.merge(drafter_graphdef, params), taps, target.model.embed_tokens(block), anchors)
        logits = draft_logits(cfg, target.logits(hidden)).astype(jnp.float32)  # [B, N, Bk, V]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        w = jnp.broadcast_to(weights, ce.shape)
        hit = (logits.argmax(-1) == labels)
        return (ce * w).sum() / w.sum(), {"acc": hit[..., 1:].mean(), "acc1": hit[..., 1].mean()}

    return loss_fn


def anchor_batches(seqs: np.ndarray, taps: np.ndarray, prompt_len: int, *, block: int, anchors: int, batch: int,
                   seed: int) -> Iterator[dict]:
    """Endless seeded batches: sequences drawn at random, ``anchors`` distinct sorted anchors each.

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
        yield {"tokens": seqs[rows], "taps": taps[rows], "anchors": a.astype(np.int32)}


def train_drafter(target: Target, cfg: DrafterConfig, seqs: np.ndarray, prompt_len: int, tcfg: loop.TrainConfig,
                  *, anchors: int, batch: int, seed: int = 0, ckpt_dir: str | Path | None = None,
                  log_file: str | Path | None = None) -> tuple[Drafter, loop.Result]:
    """Trains a fresh drafter on target-regenerated sequences [N, L] (the first prompt_len are the prompt)."""
    drafter = init_drafter(cfg, dtype=jnp.float32, seed=seed)
    taps = compute_taps(target, seqs, cfg.target_layer_ids)
    batches = anchor_batches(seqs, taps, prompt_len, block=cfg.block_size, anchors=anchors, batch=batch,
                             seed=seed + 1)
    loss_fn = drafter_loss_fn(drafter.graphdef, target.graphdef, cfg)
    res = loop.train(loss_fn, drafter.params, target.params, batches, tcfg, ckpt_dir=ckpt_dir, desc="drafter",
                     log_file=log_file)
    return Drafter(cfg, drafter.graphdef, res.params), res

