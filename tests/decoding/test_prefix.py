"""Prompt prefixes kept for reuse (``decoding.prefix``, ``prefill_prefix`` / ``generate(prefix=)``) and prompts
prefilled in chunks (``target.extend``, ``SpeculativeLoop.extend``), on tiny random models: a prompt prefilled in
chunks has the cache of prefilling it whole; a prefix restored into rows (target and proposer state) decodes as the
whole prompt does, for every proposer; the store's chain, LRU order and byte bound. The engine's prefix cache on
the shipped pair: tests/serve/test_engine.py and test_prefix_cache.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.decoding import prefix as store_mod
from dflash_jax.decoding.api import generate, prefill_prefix
from dflash_jax.decoding.mtp import MTPProposer, mtp_params
from dflash_jax.decoding.proposers import DFlashProposer
from dflash_jax.decoding.sampling import SamplingConfig
from dflash_jax.models import drafter as dr
from dflash_jax.models.cache import GDNCache
from dflash_jax.models.target import extend, init_target, prefill

V = 32


@pytest.fixture(scope="module")
def target():
    cfg = TargetConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2,
                       layer_types=("linear_attention", "full_attention"), num_attention_heads=2,
                       num_key_value_heads=1, head_dim=8, linear_num_key_heads=1, linear_num_value_heads=2,
                       linear_key_head_dim=8, linear_value_head_dim=8, intermediate_size=24, mtp_num_hidden_layers=1)
    return init_target(cfg, seed=3, mtp=True)


@pytest.fixture(scope="module")
def drafter():
    cfg = DrafterConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                        head_dim=16, intermediate_size=24, vocab_size=V, block_size=4, mask_token_id=V - 1,
                        target_layer_ids=(0, 1), num_target_layers=2)
    return dr.init_drafter(cfg, seed=4)


def test_a_prompt_in_chunks_has_the_cache_of_it_whole(target):
    tokens = np.random.default_rng(0).integers(0, V, 45).astype(np.int32)
    whole_out, whole = prefill(target.graphdef, target.params, jnp.asarray(tokens[None]), jnp.asarray([45]),
                               capacity=96)
    out, cache = prefill(target.graphdef, target.params, jnp.asarray(tokens[None, :16]), jnp.asarray([16]),
                         capacity=96)
    for start, end in ((16, 32), (32, 45)):  # each chunk padded to 16
        chunk = np.zeros((1, 16), np.int32)
        chunk[0, :end - start] = tokens[start:end]
        out, cache = extend(target.graphdef, target.params, jnp.asarray(chunk), jnp.asarray([end - start]), cache)
    assert int(cache.lengths[0]) == 45
    np.testing.assert_allclose(out.logits, whole_out.logits, atol=1e-5)
    for got, want in zip(cache.layers, whole.layers, strict=True):
        if isinstance(got, GDNCache):
            np.testing.assert_allclose(got.state, want.state, atol=1e-5)
            np.testing.assert_allclose(got.conv, want.conv, atol=1e-6)
        else:
            np.testing.assert_allclose(got.k[:, :, :45], want.k[:, :, :45], atol=1e-5)


def _proposers(target, drafter):
    return {"ar": None, "mtp": (MTPProposer.of(target, 2), mtp_params(target)), "dflash": drafter}


@pytest.mark.parametrize("method, samplings", [
    ("dflash", ("greedy",)),
    pytest.param("dflash", ("sampled",), marks=pytest.mark.slow),
    pytest.param("mtp", ("greedy", "sampled"), marks=pytest.mark.slow),
    pytest.param("ar", ("greedy", "sampled"), marks=pytest.mark.slow)])
def test_generate_from_a_prefix_equals_generate(target, drafter, method, samplings):
    """Rows resuming one token past the prefix (its first token reads the restored state at once) and five past it:
    greedy tokens and verify steps (the drafter's restored context drafts as the whole prompt's) and a seeded
    sampled run equal ``generate`` of the whole prompts."""
    draft = _proposers(target, drafter)[method]
    rng = np.random.default_rng(1)
    head = rng.integers(0, V, 21).tolist()
    prompts = [head + [5], head + rng.integers(0, V, 5).tolist()]
    prefix = prefill_prefix(target, head, drafter=draft)
    rules = {"greedy": SamplingConfig(), "sampled": SamplingConfig(temperature=0.9)}
    for sampling in (rules[s] for s in samplings):
        want = generate(target, prompts, drafter=draft, max_new_tokens=12, sampling=sampling, rng=7, stop_ids=())
        got = generate(target, prompts, drafter=draft, max_new_tokens=12, sampling=sampling, rng=7, stop_ids=(),
                       prefix=prefix)
        assert got.token_lists() == want.token_lists()
        np.testing.assert_array_equal(got.steps, want.steps)


def test_a_prefix_is_refused_for_other_prompts_or_another_drafter(target, drafter):
    prefix = prefill_prefix(target, [1, 2, 3], drafter=drafter)
    with pytest.raises(ValueError, match="does not start with the prefix's 3 tokens"):
        generate(target, [[1, 2, 4, 5]], drafter=drafter, prefix=prefix)
    with pytest.raises(ValueError, match="does not start with the prefix's 3 tokens"):
        generate(target, [[1, 2, 3]], drafter=drafter, prefix=prefix)  # nothing left to prefill
    with pytest.raises(ValueError, match="prefilled for another target or drafter"):
        generate(target, [[1, 2, 3, 4]], prefix=prefix)


def _page(nbytes: int):
    return (jnp.zeros((nbytes // 4,), jnp.float32),)


def test_the_store_matches_block_chains_and_resumes_from_the_deepest_snapshot():
    store = store_mod.PrefixStore(block=4, capacity_bytes=10_000)
    prompt = list(range(13))
    store.add(prompt[:4], lambda b: _page(64), lambda: _page(32))
    store.add(prompt[:12], lambda b: _page(64), lambda: _page(32))  # blocks 1, 2 new; a snapshot at 12
    assert store.stats()["entries"] == 3 and store.bytes == 3 * 64 + 2 * 32
    hit = store.lookup(prompt)  # 13 tokens: resumes at 12, one token left
    assert (hit.length, len(hit.pages)) == (12, 3)
    assert store.lookup(prompt[:12]).length == 4  # at least one token is left to prefill: not 12
    assert store.lookup([0, 1, 2, 9, 4, 5, 6, 7, 8]).length == 0  # a different first block: no chain
    other = [0, 1, 2, 3, 9, 9, 9, 9, 9]  # the same first block, then another: resumes at 4
    assert store.lookup(other).length == 4
    s = store.stats()
    assert (s["hits"], s["misses"], s["cached_tokens"]) == (3, 1, 20)


def test_the_store_resumes_from_a_tail_snapshot_past_the_last_whole_block():
    """A snapshot at a length that is not whole blocks (a finished request's prompt and reply) is a tail entry under
    its last whole block: a prompt that starts with its tokens and goes on resumes there, others do not."""
    store = store_mod.PrefixStore(block=4, capacity_bytes=10_000)
    tokens = list(range(20))
    store.add(tokens[:4], lambda b: _page(64), lambda: _page(32))  # a snapshot at 4
    pages = []
    store.add(tokens[:10], lambda b: pages.append(b) or _page(64), lambda: _page(32))  # block 0 again, 1, the tail
    assert pages == [0, 1, 2] and store.stats()["entries"] == 3 and store.bytes == 3 * 64 + 2 * 32
    store.add(tokens[:10], lambda b: _page(64), lambda: _page(32))  # stored already: nothing new
    assert store.bytes == 3 * 64 + 2 * 32
    hit = store.lookup(tokens[:13])
    assert (hit.length, len(hit.pages)) == (10, 3)
    assert store.lookup(tokens[:10]).length == 4  # one token left to prefill: not the tail at 10
    assert store.lookup(tokens[:9] + [99, 98]).length == 4  # the tail's tokens differ
    store.add([7, 7], lambda b: _page(64), lambda: _page(32))  # a tail under no block
    assert store.lookup([7, 7, 7]).length == 2 and store.lookup([7, 8, 7]).length == 0
    for key in list(store._entries):
        if key[0] == -1 and len(key[1]) == 4:
            store._drop(store._entries[key])  # the chain's root: its blocks and tail go with it
    assert store.lookup(tokens[:13]).length == 0 and store.bytes == 64 + 32 and store.lookup([7, 7, 7]).length == 2


def test_the_store_evicts_least_recently_used_chains_deepest_first_within_its_bytes():
    store = store_mod.PrefixStore(block=2, capacity_bytes=1000)
    a, b = [1, 1, 2, 2, 3], [7, 7, 8, 8, 9]
    store.add(a[:4], lambda i: _page(200), lambda: _page(40))  # 440 bytes
    store.add(b[:4], lambda i: _page(200), lambda: _page(40))  # 880
    assert store.lookup(a).length == 4  # a used last
    store.add([5, 5], lambda i: _page(200), lambda: _page(40))  # 1120 > 1000: b's deepest block goes first
    s = store.stats()
    assert s["bytes"] <= 1000 and s["evictions"] == 1
    assert store.lookup(a).length == 4 and store.lookup(b).length == 0  # b's snapshot was on its deepest block
    store.add([6] * 8, lambda i: _page(200), lambda: _page(40))  # 840 more: only this chain fits, the rest goes
    assert store.bytes <= 1000 and store.lookup(a).length == 0 and store.lookup([6] * 9).length == 8
    store.add([4] * 2, lambda i: _page(2000), lambda: _page(40))  # larger than the whole store: kept nowhere
    assert store.lookup([4] * 3).length == 0 and store.lookup([6] * 9).length == 8


def test_the_layout_finds_every_position_axis_of_the_proposers_state(target, drafter):
    from dflash_jax.decoding.loop import SpecConfig, SpeculativeLoop

    for draft in (DFlashProposer(drafter.cfg, drafter.graphdef), MTPProposer.of(target, 2)):
        pparams = drafter.params if isinstance(draft, DFlashProposer) else mtp_params(target)
        loop = SpeculativeLoop.of(target, draft, SpecConfig(block_size=3, capacity=40))
        layout = store_mod.Layout.of(loop, (target.params, pparams))
        shapes = jax.tree.leaves(jax.eval_shape(lambda p, loop=loop: loop.empty(p, 1), (target.params, pparams)))
        pages = [s.shape for s, a in zip(shapes, layout.axes, strict=True) if a >= 0]
        assert len(pages) == 4 and all(shape[a] == 40 for shape, a in zip(
            pages, [a for a in layout.axes if a >= 0], strict=True))  # target K, V and the proposer's K, V
