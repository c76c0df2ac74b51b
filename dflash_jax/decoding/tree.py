"""Draft trees (DDTree, Ringel & Romano, arXiv 2604.12989): grown on device from a drafter's distributions,
walked with the target's own choices.

Sits beside ``sampling.py`` under the loop (``loop.py``): the draft phase grows a tree from the drafter's
distributions at depths 1..D (``grow``), the target verifies all its tokens in one pass (``target.verify`` with
``parents``), and the settle phase walks it (``choices`` at every node, then ``walk``).

The tree holds the ``N`` (the static budget) best root-to-node paths, a path's score being the sum of its tokens'
log-probabilities, each conditioned on the path before it. Which conditionals: a DFlash drafter's per-position
marginals (``build``: every node at a depth has the same children), or a DFlash2 drafter's candidate selector,
which scores each depth's candidates given the token of the node it extends (``proposers.DFlashProposer.tree``).
Growth is one pass per depth, batched over the nodes: the frontier (a depth's ``min(N, ...)`` best nodes) is
extended by each node's best children and the next frontier is the best of them. A node's score is at most its
parent's, so each of the N best paths has its parent among the N best and among its depth's N best: the
frontiers hold all of them, and the N best of all the frontiers' nodes are exactly the N best paths (ties go to
the earlier node, a parent before its children). Row layout: index 0 is the root (the anchor, depth 0), nodes
1..N follow by depth, so parents precede children, as the verify needs; children of one node carry distinct
tokens.

The tree is the likeliest paths under every sampling setting (draft mode and temperature leave it alone): a
fixed tree catches the target's choice at a node with the probability the target gives that node's children, so
the children the drafter finds likeliest are the best guess. Measured (docs/performance.md, "Sampled
acceptance"): trees sampled without replacement from the drafter at the sampling temperature (stochastic beam
search) accepted less at T 1, 0.7 and 0.2 on the shipped pair, with either drafter.

Acceptance is the target's: at each node the token it chooses there (its argmax, or a sample from its
distribution under the row's rules); from the root, step to the child holding that token while there is one;
the first choice without such a child is the bonus. Every emitted token is then the target's own choice given
the accepted prefix, so greedy output equals plain decoding and sampled output has the target's distribution
(the drafter's probabilities are never used, and the tree is fixed before the target draws). The chain is the tree
with one child per node.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from dflash_jax.decoding.sampling import RowSampling, SamplingConfig, argmax, probs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftTree:
    """A draft tree per row: N + 1 nodes, the anchor at 0, parents before children."""

    tokens: jax.Array  # [B, N+1] int32; tokens[:, 0] the anchor
    parents: jax.Array  # [B, N+1] int32; -1 at the root
    depths: jax.Array  # [B, N+1] int32; 0 at the root, at most D
    valid: jax.Array  # [B, N+1] bool; False for the nodes a budget beyond every finite path leaves empty


# children(t, tokens [B, W]) -> (log-probabilities [B, W, K] f32, tokens [B, W, K] int32): the K candidates after
# each of W nodes at depth t (0: the root) whose tokens are ``tokens``, each row of K distinct tokens.
Children = Callable[[int, jax.Array], tuple[jax.Array, jax.Array]]


def build(anchor: jax.Array, logprobs: jax.Array, budget: int) -> DraftTree:
    """The ``budget`` best paths of per-depth draft log-probabilities (a DFlash drafter's marginals).

    Args:
      anchor: [B] int32, the root's token.
      logprobs: [B, D, V] f32 log-probabilities of depth 1..D (a log-softmax of the drafter's logits).
      budget: N, nodes besides the root (static).
    Returns:
      a ``DraftTree`` of N + 1 nodes per row (nodes past the finite paths are marked invalid).
    """
    B, D, V = logprobs.shape
    vals, toks = jax.lax.top_k(logprobs.astype(jnp.float32), min(budget, V))  # [B, D, K] descending

    def children(t, tokens):  # the same K children after every node at depth t
        shape = tokens.shape + vals.shape[-1:]
        return jnp.broadcast_to(vals[:, t, None], shape), jnp.broadcast_to(toks[:, t, None], shape).astype(jnp.int32)

    return grow(anchor, children, D, budget)


def grow(anchor: jax.Array, children: Children, depth: int, budget: int) -> DraftTree:
    """The ``budget`` best paths of depth <= ``depth`` under ``children``'s conditional distributions.

    Args:
      anchor: [B] int32, the root's token.
      children: the candidates after a depth's nodes and their log-probabilities (``Children``).
      depth: D (static); budget: N, nodes besides the root (static).
    Returns:
      a ``DraftTree`` of N + 1 nodes per row, by depth (nodes past the finite paths are marked invalid).
    """
    B = anchor.shape[0]
    rows = jnp.arange(B)[:, None]
    tokens, score = anchor.astype(jnp.int32)[:, None], jnp.zeros((B, 1))  # the frontier: the root
    levels = []  # per depth: (tokens [B, W], parent's index in the previous frontier [B, W], score [B, W])
    for t in range(depth):
        lq, cand = children(t, tokens)  # [B, W, K]
        W, K = lq.shape[1:]
        path = score[:, :, None] + lq  # [B, W, K] the children's path log-probabilities
        score, index = jax.lax.top_k(path.reshape(B, W * K), min(budget, W * K))  # the next frontier
        tokens = cand.reshape(B, W * K)[rows, index]
        levels.append((tokens, index // K, score))
    sizes = [lv[0].shape[1] for lv in levels]
    starts = [sum(sizes[:t]) for t in range(depth)]
    pad = max(budget - sum(sizes), 0)  # a budget beyond every path: invalid nodes at the end
    flat = lambda xs, fill: jnp.concatenate(xs + [jnp.full((B, pad), fill, xs[0].dtype)], axis=1)  # noqa: E731
    tok = flat([lv[0] for lv in levels], 0)
    up = flat([jnp.full_like(levels[0][1], -1)] + [lv[1] + starts[t - 1] for t, lv in enumerate(levels) if t], -1)
    dep = flat([jnp.full_like(lv[0], t + 1) for t, lv in enumerate(levels)], 0)
    scores = flat([lv[2] for lv in levels], -jnp.inf)
    _, chosen = jax.lax.top_k(scores, budget)  # ties: the lower index, a parent before its children
    chosen = jnp.sort(chosen, axis=1)  # [B, N] by depth
    node = jnp.full(tok.shape, -1, jnp.int32).at[rows, chosen].set(jnp.arange(1, budget + 1, dtype=jnp.int32))
    up = up[rows, chosen]
    parent = jnp.where(up < 0, 0, node[rows, jnp.maximum(up, 0)])  # -1: a parent left out (never, but then unreached)
    valid = (scores[rows, chosen] > -jnp.inf) & (parent >= 0)
    first = lambda x, v: jnp.concatenate([jnp.full((B, 1), v, x.dtype), x], axis=1)  # noqa: E731
    return DraftTree(tokens=first(jnp.where(valid, tok[rows, chosen], 0), anchor.astype(jnp.int32)[:, None]),
                     parents=first(jnp.where(valid, parent, 0), -1), depths=first(dep[rows, chosen], 0),
                     valid=first(valid, True))


def choices(logits: jax.Array, keys: jax.Array, rules: SamplingConfig | RowSampling) -> jax.Array:
    """The target's choice at every node: logits [B, T, V], keys [B] -> [B, T] int32 (argmax at temperature 0,
    else one independent draw per node from ``sampling.probs``)."""
    if isinstance(rules, SamplingConfig) and rules.greedy:
        return argmax(logits)
    T = logits.shape[1]
    p = probs(logits, rules)  # [B, T, V]
    node_keys = jax.vmap(lambda key: jax.random.split(key, T))(keys)  # [B, T]
    drawn = jax.vmap(jax.vmap(lambda key, pb: jax.random.categorical(key, jnp.log(pb))))(node_keys, p)
    drawn = drawn.astype(jnp.int32)
    return jnp.where(rules.rows(drawn, "temperature") == 0, argmax(logits), drawn) if isinstance(
        rules, RowSampling) else drawn


def walk(tree: DraftTree, chosen: jax.Array, max_depth: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Follows the target's choices down the tree.

    Args:
      tree: the verified tree; chosen: [B, N+1] the target's token at each node (``choices``);
      max_depth: D, the deepest node (static).
    Returns:
      (path [B, D+1] int32: the accepted nodes from the root, 0 past the last; a [B] int32 accepted drafts,
      so path[:, :a+1] is kept; bonus [B]: the choice at the last accepted node).
    """
    B = chosen.shape[0]
    rows = jnp.arange(B)
    cur = jnp.zeros((B,), jnp.int32)
    going = jnp.ones((B,), bool)
    path = [cur]
    for _ in range(max_depth):
        want = chosen[rows, cur]  # [B]
        hit = tree.valid & (tree.parents == cur[:, None]) & (tree.tokens == want[:, None])  # [B, N+1]
        going = going & hit.any(1)
        cur = jnp.where(going, jnp.argmax(hit, axis=1).astype(jnp.int32), cur)
        path.append(jnp.where(going, cur, 0))
    path = jnp.stack(path, axis=1)
    a = (path[:, 1:] > 0).sum(1).astype(jnp.int32)
    return path, a, chosen[rows, cur]
