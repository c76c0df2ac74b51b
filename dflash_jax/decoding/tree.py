"""Draft trees (DDTree, Ringel & Romano, arXiv 2604.12989): built on device from the drafter's per-depth
distributions, walked with the target's own choices.

Sits beside ``sampling.py`` under the loop (``loop.py``): the draft phase turns a DFlash block's log-probabilities
at depths 1..D into a tree (``build``), the target verifies all its tokens in one pass (``target.verify`` with
``parents``), and the settle phase walks it (``choices`` at every node, then ``walk``).

The tree holds the ``N`` (the static budget) highest-scoring token prefixes, a prefix's score being the sum of
its tokens' log-probabilities at their depths. It is grown best first: the best candidate is popped and added,
and its next-ranked sibling (same depth and parent) and its first-ranked child become candidates. Both score no
more than the node itself, so the N pops are exactly the N best prefixes, each after its parent and its
better-ranked siblings: parents precede children, as the verify needs. Row layout: index 0 is the root (the
anchor, depth 0), nodes 1..N follow in pop order; children of one node carry distinct tokens (distinct ranks).

Acceptance is the target's: at each node the token it chooses there (its argmax, or a sample from its
distribution under the row's rules); from the root, step to the child holding that token while there is one;
the first choice without such a child is the bonus. Every emitted token is then the target's own choice given
the accepted prefix, so greedy output equals plain decoding and sampled output has the target's distribution
(the drafter's probabilities are never used). The chain is the tree with one child per node.
"""

from __future__ import annotations

import dataclasses

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
    valid: jax.Array  # [B, N+1] bool; False for the nodes a budget beyond every finite prefix leaves empty


def build(anchor: jax.Array, logprobs: jax.Array, budget: int) -> DraftTree:
    """The ``budget`` best prefixes of per-depth draft log-probabilities.

    Args:
      anchor: [B] int32, the root's token.
      logprobs: [B, D, V] f32 log-probabilities of depth 1..D (a log-softmax of the drafter's logits).
      budget: N, nodes besides the root (static).
    Returns:
      a ``DraftTree`` of N + 1 nodes per row (nodes past the finite prefixes are marked invalid).
    """
    D, V = logprobs.shape[1:]
    K = min(budget, V)  # no node ranks deeper than the budget among its siblings
    vals, toks = jax.lax.top_k(logprobs.astype(jnp.float32), K)  # [B, D, K] descending
    return jax.vmap(lambda a, v, t: _grow(a, v, t, budget, D, K))(anchor, vals, toks.astype(jnp.int32))


def _grow(anchor, vals, toks, N: int, D: int, K: int) -> DraftTree:
    """One row of ``build``: N best-first pops over candidate slots (score, depth, rank, parent).

    The popped slot takes the popped node's next sibling, slot i + 1 its first child: N + 1 slots hold every
    live candidate. vals/toks [D, K]."""
    neg = jnp.float32(-jnp.inf)
    slots = N + 1
    score = jnp.full((slots,), neg).at[0].set(vals[0, 0])
    depth = jnp.ones((slots,), jnp.int32)
    rank = jnp.zeros((slots,), jnp.int32)
    parent = jnp.zeros((slots,), jnp.int32)
    nodes = (jnp.zeros((N + 1,), jnp.int32).at[0].set(anchor), jnp.full((N + 1,), -1, jnp.int32),
             jnp.zeros((N + 1,), jnp.int32), jnp.zeros((N + 1,), bool).at[0].set(True))

    def pop(i, carry):
        (score, depth, rank, parent), (tok, par, dep, ok) = carry
        j = jnp.argmax(score)
        s, d, r, p = score[j], depth[j], rank[j], parent[j]
        live = s > neg
        node = i + 1
        tok = tok.at[node].set(jnp.where(live, toks[d - 1, r], 0))
        par, dep, ok = par.at[node].set(jnp.where(live, p, 0)), dep.at[node].set(d), ok.at[node].set(live)
        sib = jnp.where((r + 1 < K) & live, s - vals[d - 1, r] + vals[d - 1, jnp.minimum(r + 1, K - 1)], neg)
        child = jnp.where((d < D) & live, s + vals[jnp.minimum(d, D - 1), 0], neg)
        score = score.at[j].set(sib).at[node].set(child)
        rank = rank.at[j].set(r + 1).at[node].set(0)
        depth = depth.at[node].set(d + 1)
        parent = parent.at[node].set(node)
        return (score, depth, rank, parent), (tok, par, dep, ok)

    _, (tok, par, dep, ok) = jax.lax.fori_loop(0, N, pop, ((score, depth, rank, parent), nodes))
    return DraftTree(tokens=tok, parents=par, depths=dep, valid=ok)


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
