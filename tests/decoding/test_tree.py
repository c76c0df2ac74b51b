"""Draft trees (DDTree): the tree verify against each node's path run alone as a chain, the tree form of the
gated delta rule against the per-path recurrence in float64, the commit of a path against the chain's, the
tree build and walk, and the loop lossless against plain decoding (greedy) and the exact distribution (sampled).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import kernels
from dflash_jax.config import TargetConfig
from dflash_jax.models.cache import AttentionCache, GDNCache
from dflash_jax.models.target import init_target, tree_of

CAPACITY, PROMPT = 64, 7


def _config(moe: bool = False) -> TargetConfig:
    extra = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                 shared_expert_intermediate_size=16) if moe else dict(intermediate_size=24)
    return TargetConfig(vocab_size=32, hidden_size=16, num_hidden_layers=3,
                        layer_types=("linear_attention", "full_attention", "linear_attention"),
                        num_attention_heads=2, num_key_value_heads=1, head_dim=8, linear_num_key_heads=1,
                        linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, **extra)


def random_parents(rng: np.random.Generator, B: int, T: int) -> np.ndarray:
    """[B, T] parents of random trees (root 0, each token's parent an earlier token; root's entry -1)."""
    parents = np.full((B, T), -1, np.int32)
    for b in range(B):
        for t in range(1, T):
            parents[b, t] = rng.integers(0, t) if rng.random() < 0.6 else t - 1  # deep and bushy
    return parents


def path_to(parents: np.ndarray, t: int) -> list[int]:
    """Root -> t token indices of one row's parents."""
    path = [t]
    while path[-1] != 0:
        path.append(int(parents[path[-1]]))
    return path[::-1]


def _copy(cache):
    return jax.tree.map(jnp.copy, cache)


@pytest.fixture(scope="module", params=["dense", "moe"])
def target(request):
    return init_target(_config(request.param == "moe"), seed=5)


def _prefilled(target, B, seed=0):
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, target.cfg.vocab_size, (B, PROMPT)).astype(np.int32)
    lengths = np.array([PROMPT - b % 3 for b in range(B)], np.int32)  # rows at different positions
    _, cache = target.prefill(prompts, lengths, capacity=CAPACITY, taps=(0, 2))
    return cache


def test_every_node_equals_its_path_run_alone_as_a_chain(target):
    """Logits and taps of each node of a random tree = the last position of its root -> node path verified
    alone as a chain, in every row (rows at different lengths); the chain itself is the tree of parents i - 1."""
    B, T = 2, 9
    rng = np.random.default_rng(1)
    cache = _prefilled(target, B)
    tokens = rng.integers(0, target.cfg.vocab_size, (B, T)).astype(np.int32)
    parents = random_parents(rng, B, T)
    tree_out, _ = target.verify(tokens, _copy(cache), taps=(0, 2), parents=parents)
    for b in range(B):
        for t in range(T):
            path = path_to(parents[b], t)  # a chain of T tokens: the path, then tokens its last one cannot see
            chain = np.concatenate([tokens[:, path], tokens[:, :T - len(path)]], axis=1)
            out, _ = target.verify(chain, _copy(cache), taps=(0, 2))
            end = len(path) - 1
            np.testing.assert_allclose(tree_out.logits[b, t], out.logits[b, end], atol=2e-5, rtol=1e-5)
            np.testing.assert_allclose(tree_out.taps[b, t], out.taps[b, end], atol=2e-5, rtol=1e-5)
    chain = np.broadcast_to(np.arange(T, dtype=np.int32) - 1, (B, T))
    as_tree, _ = target.verify(tokens, _copy(cache), taps=(0, 2), parents=chain)
    as_chain, _ = target.verify(tokens, _copy(cache), taps=(0, 2))
    np.testing.assert_allclose(as_tree.logits, as_chain.logits, atol=2e-5, rtol=1e-5)


def _assert_caches_equal(a, b, atol=2e-5):
    np.testing.assert_array_equal(a.lengths, b.lengths)
    for la, lb in zip(a.layers, b.layers, strict=True):
        if isinstance(la, GDNCache):
            assert la.pending is None and lb.pending is None
            np.testing.assert_allclose(la.state, lb.state, atol=atol, rtol=1e-5)
            np.testing.assert_allclose(la.conv, lb.conv, atol=atol, rtol=1e-5)
        else:
            assert isinstance(la, AttentionCache)
            for x, y, axis in ((np.asarray(la.k), np.asarray(lb.k), 2), (np.asarray(la.v), np.asarray(lb.v), 3)):
                for row in range(a.lengths.shape[0]):
                    n = int(a.lengths[row])  # committed rows only
                    np.testing.assert_allclose(np.take(x[row], np.arange(n), axis=axis - 1),
                                               np.take(y[row], np.arange(n), axis=axis - 1), atol=atol, rtol=1e-5)


def test_commit_of_a_path_equals_the_chain_of_its_tokens(target):
    """Committing a tree's accepted path (each row its own path and length, 0 included) leaves the cache of
    verifying and committing the path's tokens as a chain: GDN states and conv windows, K/V rows, lengths;
    and the next step from both caches gives the same logits."""
    B, T = 3, 10
    rng = np.random.default_rng(2)
    cache = _prefilled(target, B, seed=1)
    tokens = rng.integers(0, target.cfg.vocab_size, (B, T)).astype(np.int32)
    parents = random_parents(rng, B, T)
    leaves = [T - 1, int(rng.integers(1, T)), 0]
    paths = [path_to(parents[b], leaves[b]) for b in range(B)]
    n = np.array([len(paths[0]), len(paths[1]) - 1, 0], np.int32)  # a whole path, a prefix, nothing
    P = max(len(p) for p in paths)
    path = np.zeros((B, P), np.int32)
    for b, p in enumerate(paths):
        path[b, :len(p)] = p
    _, verified = target.verify(tokens, _copy(cache), parents=parents)
    tree_cache = target.commit(verified, n, path)
    chain_tokens = np.take_along_axis(tokens, path, axis=1)
    _, verified = target.verify(chain_tokens, _copy(cache))
    chain_cache = target.commit(verified, n)
    _assert_caches_equal(tree_cache, chain_cache)
    nxt = rng.integers(0, target.cfg.vocab_size, (B, 3)).astype(np.int32)
    a, _ = target.verify(nxt, tree_cache)
    c, _ = target.verify(nxt, chain_cache)
    np.testing.assert_allclose(a.logits, c.logits, atol=2e-5, rtol=1e-5)


def test_tree_of_ancestors_depths_and_conv_reach():
    parents = np.array([[-1, 0, 0, 1, 3, 2]], np.int32)
    tree = tree_of(jnp.asarray(parents), 4)
    np.testing.assert_array_equal(tree.depths[0], [0, 1, 1, 2, 3, 2])
    for t in range(6):
        np.testing.assert_array_equal(np.flatnonzero(tree.mask[0, t]), sorted(path_to(parents[0], t)))
    np.testing.assert_array_equal(tree.up[0, 4], [4, 3, 1, 0])
    np.testing.assert_array_equal(tree.up[0, 5], [5, 2, 0, -1])  # past the root: the conv window
    np.testing.assert_array_equal(tree.up[0, 0], [0, -1, -2, -3])


# ---- the tree form of the gated delta rule, float64, against the recurrence along each path ----


def _path_recurrence(q, k, v, g, beta, S0, path):
    """numpy float64: o and u of the last token of ``path`` run token by token (one value head)."""
    S = S0.copy()
    for i in path:
        S = np.exp(g[i]) * S
        u = beta[i] * (v[i] - S.T @ k[i])
        S = S + np.outer(k[i], u)
    return S.T @ q[path[-1]], u, S


def _tree_closed_form(q, k, v, g, beta, S0, mask):
    """numpy float64, one value head: every token's output and write from the ancestor mask [T, T] in one
    triangular solve (path-cumulative decays; the WY form on a tree), as ``kernels.gdn_verify``'s tree form."""
    T = len(g)
    G = mask @ g  # path-cumulative log-decay
    decay = np.where(mask, np.exp(G[:, None] - G[None, :]), 0.0)
    A = (mask & ~np.eye(T, dtype=bool)) * beta[:, None] * (k @ k.T) * decay
    u = np.linalg.solve(np.eye(T) + A, beta[:, None] * (v - np.exp(G)[:, None] * (k @ S0)))
    return np.exp(G)[:, None] * (q @ S0) + ((q @ k.T) * decay) @ u, u


def test_tree_closed_form_equals_the_recurrence_along_each_path():
    """The tree form of the gated delta rule (one triangular solve for every node) against the recurrence
    run along each node's path: the math in float64 (numpy, to 1e-12), then ``kernels.gdn_verify``'s tree
    form in f32 (by the inverse, and by depth rounds), and the commit's replay of a path's writes (the
    chain's closed form on gathered inputs) against the path's recurrent state."""
    rng = np.random.default_rng(3)
    B, T, Hk, Hv, Dk, Dv = 2, 12, 1, 2, 4, 3
    k = rng.normal(size=(B, T, Hk, Dk))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    q = rng.normal(size=(B, T, Hk, Dk)) / 2
    v = rng.normal(size=(B, T, Hv, Dv))
    g = -rng.uniform(0.01, 1.0, (B, T, Hv))
    beta = rng.uniform(0.1, 1.0, (B, T, Hv))
    S0 = rng.normal(size=(B, Hv, Dk, Dv))
    parents = random_parents(rng, B, T)
    tree = tree_of(jnp.asarray(parents), 1)
    mask = np.asarray(tree.mask)
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta, S0)]
    o, u = (np.asarray(x) for x in kernels.gdn_verify(*f32, impl="reference", tree=tree.mask))
    deepest = int(np.asarray(tree.depths).max())  # the solve by depth rounds (a draft tree's) gives the same
    by_depth = kernels.gdn_verify(*f32, impl="reference", tree=tree.mask, tree_depth=deepest)
    np.testing.assert_allclose(by_depth[0], o, atol=2e-5)
    np.testing.assert_allclose(by_depth[1], u, atol=2e-5)
    short = kernels.gdn_verify(*f32, impl="reference", tree=tree.mask, tree_depth=deepest - 1)
    assert np.abs(np.asarray(short[1]) - u).max() > 1e-5  # one round short leaves the deepest tokens unsolved
    for b in range(B):
        for h in range(Hv):
            args = (q[b, :, 0], k[b, :, 0], v[b, :, h], g[b, :, h], beta[b, :, h], S0[b, h])
            o64, u64 = _tree_closed_form(*args, mask[b])
            for t in range(T):
                o_t, u_t, _ = _path_recurrence(*args, path_to(parents[b], t))
                np.testing.assert_allclose(o64[t], o_t, atol=1e-12)
                np.testing.assert_allclose(u64[t], u_t, atol=1e-12)
                np.testing.assert_allclose(o[b, t, h], o_t, atol=2e-5)
                np.testing.assert_allclose(u[b, t, h], u_t, atol=2e-5)
    leaf = [path_to(parents[b], T - 1) for b in range(B)]
    P = max(map(len, leaf))
    path = np.array([p + [0] * (P - len(p)) for p in leaf])
    take = lambda x: jnp.asarray(np.take_along_axis(x, path.reshape(path.shape + (1,) * (x.ndim - 2)), axis=1),  # noqa: E731
                                 jnp.float32)
    state = np.asarray(kernels.gdn_replay(take(k), take(u), take(g), f32[5], jnp.asarray([len(p) for p in leaf]),
                                          impl="reference"))
    for b in range(B):
        for h in range(Hv):
            args = (q[b, :, 0], k[b, :, 0], v[b, :, h], g[b, :, h], beta[b, :, h], S0[b, h])
            np.testing.assert_allclose(state[b, h], _path_recurrence(*args, leaf[b])[2], atol=2e-5)


def test_tree_attention_mask_sees_the_prefix_and_the_ancestors():
    """The tree mask against the causal oracle on each node's path: query t's output = the causal attention
    of its path's last query over the prefix + the path's keys."""
    rng = np.random.default_rng(4)
    B, T, N, K, H, S, start = 2, 6, 2, 1, 8, 16, 5
    q = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)
    kc, vc = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in kernels.cache_shapes(B, S, K, H))
    parents = random_parents(rng, B, T)
    tree = tree_of(jnp.asarray(parents), 1)
    starts = jnp.full((B,), start, jnp.int32)
    o = kernels.attention(q, kc, vc, starts, starts + T, impl="reference", tree=tree.mask)
    for b in range(B):
        for t in range(T):
            p = path_to(parents[b], t)
            rows = list(range(start)) + [start + j for j in p]
            ref = kernels.attention_reference(q[b:b + 1, t:t + 1], kc[b:b + 1, :, rows], vc[b:b + 1, :, :, rows],
                                              jnp.asarray([len(rows) - 1]), jnp.asarray([len(rows)]))
            np.testing.assert_allclose(o[b, t], ref[0, 0], atol=1e-5)


@pytest.mark.parametrize("what", ["attention", "gdn"])
def test_pallas_modes_fall_back_to_the_reference_for_trees_and_say_so_once(what, caplog):
    """A tree under a Pallas kernel mode runs the XLA form (same numbers as the reference), logged once."""
    rng = np.random.default_rng(5)
    parents = random_parents(rng, 1, 5)
    tree = tree_of(jnp.asarray(parents), 1)
    if what == "attention":
        q = jnp.asarray(rng.normal(size=(1, 5, 2, 8)), jnp.float32)
        kc, vc = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in kernels.cache_shapes(1, 16, 1, 8))
        args, fn = (q, kc, vc, jnp.asarray([3]), jnp.asarray([8])), kernels.attention
    else:
        args = tuple(jnp.asarray(x, jnp.float32) for x in (
            rng.normal(size=(1, 5, 1, 4)), rng.normal(size=(1, 5, 1, 4)) / 2, rng.normal(size=(1, 5, 2, 4)),
            -rng.uniform(0, 1, (1, 5, 2)), rng.uniform(0, 1, (1, 5, 2)), rng.normal(size=(1, 2, 4, 4))))
        fn = kernels.gdn_verify
    ref = fn(*args, impl="reference", tree=tree.mask)
    with caplog.at_level("WARNING"):
        out = fn(*args, impl="interpret", tree=tree.mask)
        fn(*args, impl="interpret", tree=tree.mask)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), out, ref)
    said = [r for r in caplog.records if "tree" in r.getMessage()]
    assert len(said) <= 1  # once per process (an earlier test may have said it already)


def test_verify_refuses_parents_after_their_children(target):
    cache = _prefilled(target, 1)
    with pytest.raises(ValueError, match="parents must precede"):
        target.verify(np.zeros((1, 3), np.int32), cache, parents=np.array([[-1, 2, 0]], np.int32))



# ---- the tree: build and walk ----


def _brute_best(logprobs: np.ndarray, N: int) -> list[float]:
    """The N best prefix scores of one row's [D, V] per-depth log-probs, by enumeration."""
    D, V = logprobs.shape
    scores, frontier = [], [0.0]
    for d in range(D):
        frontier = [s + logprobs[d, v] for s in frontier for v in range(V)]
        scores += frontier
    return sorted(scores, reverse=True)[:N]


def test_build_holds_the_best_prefixes_parents_first():
    """The tree's nodes are the N highest-scoring prefixes (scores by enumeration), parents before children,
    each node's token its depth's, siblings distinct; a budget beyond every prefix leaves invalid nodes."""
    from dflash_jax.decoding import tree as draft_tree

    rng = np.random.default_rng(6)
    B, D, V, N = 3, 3, 5, 20
    logprobs = np.asarray(jax.nn.log_softmax(jnp.asarray(rng.normal(size=(B, D, V)) * 2, jnp.float32)))
    anchor = jnp.asarray([3, 1, 4], jnp.int32)
    tree = draft_tree.build(anchor, jnp.asarray(logprobs), N)
    toks, par, dep = (np.asarray(x) for x in (tree.tokens, tree.parents, tree.depths))
    assert np.asarray(tree.valid).all()
    np.testing.assert_array_equal(toks[:, 0], anchor)
    for b in range(B):
        assert par[b, 0] == -1 and dep[b, 0] == 0
        score = np.zeros(N + 1)
        for t in range(1, N + 1):
            assert 0 <= par[b, t] < t and dep[b, t] == dep[b, par[b, t]] + 1
            score[t] = score[par[b, t]] + logprobs[b, dep[b, t] - 1, toks[b, t]]
        np.testing.assert_allclose(sorted(score[1:], reverse=True), _brute_best(logprobs[b], N), rtol=1e-5)
        pairs = {(par[b, t], toks[b, t]) for t in range(1, N + 1)}
        assert len(pairs) == N  # siblings carry distinct tokens
    small = draft_tree.build(anchor, jnp.asarray(logprobs[:, :1]), 8)  # one depth of 5 tokens, budget 8
    np.testing.assert_array_equal(np.asarray(small.valid).sum(1), 1 + V)


def test_walk_follows_the_choices_while_they_are_children():
    from dflash_jax.decoding import tree as draft_tree

    #        0(anchor)
    #      /     \
    #    1:a=5   2:b=6
    #    |   \
    #  3:c=7  4:d=8
    tokens = jnp.asarray([[9, 5, 6, 7, 8]] * 3, jnp.int32)
    parents = jnp.asarray([[-1, 0, 0, 1, 1]] * 3, jnp.int32)
    tree = draft_tree.DraftTree(tokens=tokens, parents=parents, depths=jnp.asarray([[0, 1, 1, 2, 2]] * 3),
                                valid=jnp.ones((3, 5), bool))
    chosen = jnp.asarray([[5, 8, 0, 0, 11],  # 0 -> 1 -> 4, then 11: bonus
                          [6, 0, 12, 0, 0],  # 0 -> 2, then 12
                          [3, 0, 0, 0, 0]], jnp.int32)  # a miss at the root: bonus 3
    path, a, bonus = draft_tree.walk(tree, chosen, 2)
    np.testing.assert_array_equal(path, [[0, 1, 4], [0, 2, 0], [0, 0, 0]])
    np.testing.assert_array_equal(a, [2, 1, 0])
    np.testing.assert_array_equal(bonus, [11, 12, 3])


# ---- the loop: lossless ----


def _drafter(target, block=4, seed=7):
    from hf_oracle import tiny_drafter_config

    from dflash_jax.models.drafter import init_drafter

    cfg = dataclasses.replace(tiny_drafter_config(target.cfg), target_layer_ids=(0, 2), block_size=block)
    return init_drafter(cfg, seed=seed)


def _generate(target, proposer, pparams, prompts, spec, rng=0):
    from dflash_jax.decoding.api import make_generate, pad_prompts

    tokens, lengths = pad_prompts(prompts, 16)
    return make_generate(target, proposer, spec)((target.params, pparams), tokens, lengths, rng)


def test_greedy_tree_decoding_equals_plain_decoding(target):
    """A mixed batch (rows of different prompt lengths) under draft trees of two budgets emits exactly plain
    decoding's tokens, dense and MoE; the drafter's trees accept drafts."""
    from dflash_jax.decoding.loop import SpecConfig
    from dflash_jax.decoding.proposers import DFlashProposer, NoProposer

    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, target.cfg.vocab_size, n).tolist() for n in (5, 12, 1, 9)]
    plain = _generate(target, NoProposer(), (), prompts, SpecConfig(block_size=1, max_new_tokens=20, stop_ids=()))
    drafter = _drafter(target)
    proposer = DFlashProposer(drafter.cfg, drafter.graphdef)
    for budget in (3, 10):
        spec = SpecConfig(block_size=4, max_new_tokens=20, stop_ids=(), tree_budget=budget)
        out = _generate(target, proposer, drafter.params, prompts, spec)
        np.testing.assert_array_equal(out.tokens, plain.tokens, err_msg=f"budget {budget}")
        assert np.asarray(out.accepted)[:, 1:].sum() > 0


@pytest.mark.slow
def test_greedy_tree_decoding_with_an_mxfp4_target_equals_its_plain_decoding():
    """A target whose GDN, attention and MLP projections are MXFP4 (``quant.convert``; widths of 32), in a mixed
    batch under a draft tree: its own plain decoding's tokens, and the trees' drafts are accepted. Slow (two loop
    compilations, ~85 s at load 15 on 2 cores); by default the tree is guarded by the dense/MoE greedy test above
    and MXFP4 under DFlash by ``tests/models/test_quant.py``."""
    from dflash_jax.decoding.loop import SpecConfig
    from dflash_jax.decoding.proposers import DFlashProposer, NoProposer
    from dflash_jax.models import quant

    cfg = dataclasses.replace(_config(), vocab_size=64, hidden_size=32, head_dim=16, linear_key_head_dim=16,
                              linear_value_head_dim=16, intermediate_size=32)
    target = quant.convert(init_target(cfg, seed=5), True)
    names = quant.layout(target.module())["quantized"]
    assert {"model.layers.0.linear_attn.in_proj_qkv.weight", "model.layers.0.linear_attn.out_proj.weight",
            "model.layers.1.self_attn.o_proj.weight", "model.layers.2.mlp.down_proj.weight"} <= set(names)
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (6, 11, 2)]
    plain = _generate(target, NoProposer(), (), prompts, SpecConfig(block_size=1, max_new_tokens=16, stop_ids=()))
    drafter = _drafter(target)
    spec = SpecConfig(block_size=4, max_new_tokens=16, stop_ids=(), tree_budget=6)
    out = _generate(target, DFlashProposer(drafter.cfg, drafter.graphdef), drafter.params, prompts, spec)
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    assert np.asarray(out.accepted)[:, 1:].sum() > 0


def test_sampled_tree_decoding_has_the_exact_distribution(monkeypatch):
    """Sampling through draft trees: the first three tokens' joint distribution is plain sampling's, exactly
    (enumerated); the same statistic rejects a walk that ignores the target's choices (the test has power).
    The budget is the whole tree of depth 2 (every pair of tokens; the random drafter's partial trees miss the
    sharp target's choices): each emitted token is the target's sample at the node of its path.
    Partial trees are the greedy test's."""
    from exact_stats import chi2_pvalue, exact_joint, sharp_tiny_target, tiny_drafter

    from dflash_jax.decoding import tree as draft_tree
    from dflash_jax.decoding.api import make_generate, pad_prompts
    from dflash_jax.decoding.loop import SpecConfig
    from dflash_jax.decoding.proposers import DFlashProposer
    from dflash_jax.decoding.sampling import SamplingConfig

    V = 4
    target = sharp_tiny_target(V)
    drafter = tiny_drafter(V)
    dcfg = drafter.cfg
    cfg = SamplingConfig(temperature=1.0)
    prompt = np.array([1, 3, 2], np.int32)
    joint3 = exact_joint(target, prompt, cfg).reshape(V, V, V)
    N = 4000
    spec = SpecConfig(block_size=3, max_new_tokens=3, sampling=cfg, stop_ids=(), tree_budget=V + V * V)
    tokens, lengths = pad_prompts([prompt.tolist()] * N, 4)

    def sample(spec):
        fn = jax.jit(make_generate(target, DFlashProposer(dcfg, drafter.graphdef), spec))
        out = fn((target.params, drafter.params), tokens, lengths, jax.random.key(7))
        counts = np.bincount(np.ravel_multi_index(np.asarray(out.tokens).T, (V,) * 3), minlength=V**3)
        return counts.reshape(V, V, V), np.asarray(out.accepted)

    counts, accepted = sample(spec)
    assert accepted[:, 1:].sum() > N // 2  # the trees' drafts were accepted
    assert chi2_pvalue(counts.sum((0, 2)), joint3.sum((0, 2))) > 1e-4
    assert chi2_pvalue(counts.sum((0, 1)), joint3.sum((0, 1))) > 1e-4
    assert chi2_pvalue(counts.sum(0).ravel(), joint3.sum(0).ravel()) > 1e-4

    def first_child_walk(tree, chosen, max_depth):  # a wrong rule: the first node is taken whatever was chosen
        return walk(tree, chosen.at[:, 0].set(tree.tokens[:, 1]), max_depth)

    walk = draft_tree.walk
    monkeypatch.setattr(draft_tree, "walk", first_child_walk)
    wrong, _ = sample(dataclasses.replace(spec, capacity=29))  # another capacity: a program with the patch
    assert chi2_pvalue(wrong.sum(0).ravel(), joint3.sum(0).ravel()) < 1e-6


# ---- the method everywhere: names, generate and stream ----


def test_ddtree_method_names():
    from dflash_jax import frontend

    m = frontend.parse_method("ddtree:64", "--method")
    assert (m.kind, m.block, m.tree, m.name) == ("dflash", 16, 64, "ddtree:64")
    m = frontend.parse_method("ddtree:8:4")
    assert (m.block, m.tree, m.name) == (4, 8, "ddtree:8:4")
    for bad in ("ddtree:", "ddtree:0", "ddtree:x", "ddtree:4:1", "ddtree:1:2:3"):
        with pytest.raises(ValueError, match="--method"):
            frontend.parse_method(bad, "--method")


def test_generate_and_stream_take_a_tree_budget(target):
    """``generate(..., tree_budget=N)`` and ``stream`` emit plain decoding's tokens (greedy); bad budgets and a
    tree without a drafter are one-line errors."""
    from dflash_jax.decoding.api import generate, stream

    drafter = _drafter(target)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    plain = generate(target, prompts, max_new_tokens=10, stop_ids=())
    tree = generate(target, prompts, drafter=drafter, max_new_tokens=10, stop_ids=(), tree_budget=6)
    assert tree.token_lists() == plain.token_lists()
    steps = list(stream(target, prompts, drafter=drafter, max_new_tokens=10, stop_ids=(), tree_budget=6))
    assert [sum((s[b] for s in steps), []) for b in range(2)] == plain.token_lists()
    with pytest.raises(ValueError, match="tree_budget must be an integer >= 1"):
        generate(target, prompts, drafter=drafter, tree_budget=0)
    with pytest.raises(ValueError, match="need a DFlash drafter"):
        generate(target, prompts, tree_budget=4)


def test_generate_cli_method_flag():
    """``dflash-jax generate --method ddtree:N``: the method by name; with --block-size it is refused."""
    import argparse

    from dflash_jax.cli import generate as cli_generate

    args = argparse.Namespace(block_size=None, draft_model="d", method="ddtree:32")
    method = cli_generate.method_from_flags(args, None, 16)
    assert (method.name, method.block, method.tree) == ("ddtree:32", 16, 32)
    with pytest.raises(ValueError, match="leave out --block-size"):
        cli_generate.method_from_flags(argparse.Namespace(block_size=8, draft_model="d", method="ddtree:32"), None, 16)
    with pytest.raises(ValueError, match="needs a drafter"):
        cli_generate.method_from_flags(argparse.Namespace(block_size=None, draft_model=None, method="ddtree:8"),
                                       None, None)
