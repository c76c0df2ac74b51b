"""The proposers one by one, outside the loop: the typed interface, the target view, each proposer's drafts.

Loop-level properties (lossless output with each proposer, exact sampling distributions) are in
``test_loop.py``; the MTP proposer's own tests are in ``test_mtp.py``. Everything here is
torch-free: tiny random targets from a config.
"""

from __future__ import annotations

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.decoding.mtp import MTPProposer
from dflash_jax.decoding.proposers import DFlashProposer, NoProposer, OracleParams, OracleProposer, Proposer, TargetView
from dflash_jax.decoding.sampling import RowSampling, SamplingConfig
from dflash_jax.models import drafter as dr
from dflash_jax.models.target import init_target

V = 32


def _target(tie: bool = False):
    cfg = TargetConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2,
                       layer_types=("linear_attention", "full_attention"), num_attention_heads=2,
                       num_key_value_heads=1, head_dim=8, linear_num_key_heads=1, linear_num_value_heads=2,
                       linear_key_head_dim=8, linear_value_head_dim=8, intermediate_size=24,
                       tie_word_embeddings=tie, mtp_num_hidden_layers=1)
    return init_target(cfg, seed=3)


def _drafter(target, block=4, **dflash2):
    cfg = DrafterConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=16, intermediate_size=24, vocab_size=V, block_size=block, mask_token_id=V - 1,
                           target_layer_ids=(0, 1), num_target_layers=2, **dflash2)
    return dr.init_drafter(cfg, seed=4)


def _all_proposers(target):
    d = _drafter(target)
    return [NoProposer(), DFlashProposer(d.cfg, d.graphdef), OracleProposer(V), MTPProposer(target.cfg, 3)]


def test_every_proposer_implements_the_keyword_only_protocol():
    target = _target()
    for p in _all_proposers(target):
        assert isinstance(p, Proposer), type(p).__name__
        hash(p)  # static under jit: hashable
        with pytest.raises(dataclasses.FrozenInstanceError):
            p.taps = (0,)
        for name in ("init", "propose", "commit"):
            params = list(inspect.signature(getattr(p, name)).parameters.values())
            assert params and all(a.kind is inspect.Parameter.KEYWORD_ONLY for a in params), (type(p), name)
            with pytest.raises(TypeError):
                getattr(p, name)(*[None] * len(params))  # positional calls are refused


@pytest.mark.parametrize("tie", [False, True])
def test_target_view_is_the_targets_embedding_and_head(tie):
    target = _target(tie)
    module = target.module()
    view = TargetView.of(target.params)
    assert (view.lm_head is None) == tie
    tokens = jnp.array([[0, 5, V - 1]], jnp.int32)
    np.testing.assert_array_equal(view.embed(tokens), module.model.embed_tokens(tokens))
    h = jax.random.normal(jax.random.key(0), (2, 3, 16))
    np.testing.assert_allclose(view.logits(h), module.logits(h), rtol=1e-6, atol=1e-6)



@pytest.mark.parametrize("tie", [False, True])
def test_target_view_logits_are_the_targets_bit_for_bit_and_refuse_a_packed_head(tie):
    """The view's LM head is the target's own (one function, ``target.lm_logits``): equal bits and dtype in
    bf16, tied or not, and a head that is not a dense [V, D] matrix (MXFP4-packed [V, D/2]) is a clear error
    from both rather than a wrong or cryptic einsum."""
    from flax import nnx

    target = _target(tie)
    bf16 = nnx.from_flat_state([(p, v.replace(v.get_value().astype(jnp.bfloat16)))
                                for p, v in nnx.to_flat_state(target.params)])
    target = dataclasses.replace(target, params=bf16)
    h = jax.random.normal(jax.random.key(1), (2, 3, 16), jnp.bfloat16)
    got, want = TargetView.of(target.params).logits(h), target.module().logits(h)
    assert got.dtype == want.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    where = ("model", "embed_tokens", "weight") if tie else ("lm_head", "weight")
    packed = nnx.from_flat_state([(p, v.replace(jnp.zeros((V, 8), jnp.uint8)) if p == where else v)
                                  for p, v in nnx.to_flat_state(target.params)])
    for logits in (TargetView.of(packed).logits, dataclasses.replace(target, params=packed).module().logits):
        with pytest.raises(ValueError, match=r"the LM head must be a dense \[V, 16\] matrix .* got \(32, 8\)"):
            logits(h)


def _prefilled(target, taps, prompts_len=(5, 3)):
    P = max(prompts_len)
    rng = np.random.default_rng(0)
    prompts = jnp.asarray(rng.integers(0, V - 1, (len(prompts_len), P)), jnp.int32)
    lens = jnp.asarray(prompts_len, jnp.int32)
    out, _ = target.prefill(prompts, lens, capacity=16, taps=taps)
    return prompts, lens, out


def test_dflash_proposer_drafts_the_drafter_block_argmax():
    target = _target()
    d = _drafter(target)
    p = DFlashProposer(d.cfg, d.graphdef)
    assert p.taps == (0, 1) and p.max_block == 4
    prompts, lens, out = _prefilled(target, p.taps)
    view = TargetView.of(target.params)
    state = p.init(params=d.params, view=view, prefill=out, prompts=prompts, prompt_lens=lens, capacity=16)
    np.testing.assert_array_equal(state.lengths, lens)
    anchor = jnp.array([7, 2], jnp.int32)
    drafts, q, new = p.propose(params=d.params, view=view, state=state, anchor=anchor, k=3,
                               keys=jax.random.split(jax.random.key(0), 2), sampling=SamplingConfig())
    assert q is None and drafts.shape == (2, 3)
    # The same block through the drafter and the target module directly.
    model, tmod = d.module(), target.module()
    cache = dr.advance(dr.write_context(model, dr.init_draft_cache(d.cfg, 2, 16, jnp.float32), out.taps), lens)
    block = jnp.concatenate([anchor[:, None], jnp.full((2, 3), d.cfg.mask_token_id, jnp.int32)], axis=1)
    hidden, _ = dr.draft_block(model, cache, tmod.model.embed_tokens(block))
    np.testing.assert_array_equal(drafts, tmod.logits(hidden[:, 1:]).argmax(-1))
    # commit: the verify's taps are written and n tokens committed per row.
    verified = dataclasses.replace(out, taps=out.taps[:, :4])
    after = p.commit(params=d.params, view=view, state=new, verified=verified, n=jnp.array([1, 3]))
    np.testing.assert_array_equal(after.lengths, lens + jnp.array([1, 3]))


DF2 = dict(conv_kernel_size=2, conv_group_size=8, selector_rank=8, selector_top_k=5)  # a tiny DFlash2 drafter


def test_dflash2_selector_walks_each_row_at_its_own_temperature():
    """The candidate selector's walk with per-row temperatures [B] (0: the argmax path, q one-hot over the
    candidates) is, row by row, the walk at that row's scalar temperature with the same key."""
    selector = _drafter(_target(), **DF2).module().candidate_selector
    B, k = 3, 4
    hidden = jax.random.normal(jax.random.key(0), (B, k, 16))
    logits = jax.random.normal(jax.random.key(1), (B, k, V))  # flat: sampled walks leave the argmax path
    anchor, keys = jnp.array([7, 2, 9], jnp.int32), jax.random.split(jax.random.key(2), B)
    temperature = jnp.array([0.0, 1.0, 0.5], jnp.float32)
    drafts, cand, q = selector.walk(hidden, logits, anchor, keys, temperature)
    path, _, _ = selector.walk(hidden, logits, anchor, None)
    for b, t in enumerate(temperature.tolist()):
        alone, _, q_alone = selector.walk(hidden, logits, anchor, keys, t) if t else (path, None, None)
        np.testing.assert_array_equal(drafts[b], alone[b])
        want_q = jax.nn.one_hot(jnp.argmax(cand[b] == drafts[b][:, None], -1), 5) if q_alone is None else q_alone[b]
        np.testing.assert_allclose(q[b], want_q, atol=1e-6)
        assert (np.asarray(drafts[b]) != np.asarray(path[b])).any() == (t > 0), t


@pytest.mark.slow
def test_dflash2_per_row_walks_are_each_rows_own():
    """A DFlash2 drafter's selector walk under per-row rules (greedy, sampled drafts, greedy drafts, another
    temperature in one batch): each row's drafts and q are those of its own config, greedy rows take the argmax
    path with q one-hot, sampled rows leave it (the random selector's scores are flat)."""
    target = _target()
    d = _drafter(target, **DF2)
    p = DFlashProposer(d.cfg, d.graphdef)
    configs = [SamplingConfig(), SamplingConfig(1.0), SamplingConfig(1.0, draft_mode="greedy"), SamplingConfig(0.7)]
    prompts, lens, out = _prefilled(target, p.taps, (5, 3, 4, 2))
    view = TargetView.of(target.params)
    state = p.init(params=d.params, view=view, prefill=out, prompts=prompts, prompt_lens=lens, capacity=16)
    kw = dict(params=d.params, view=view, state=state, anchor=jnp.array([7, 2, 7, 2], jnp.int32), k=3,
              keys=jax.random.split(jax.random.key(1), 4))
    drafts, q = jax.jit(lambda rows: p.propose(**kw, sampling=rows)[:2])(RowSampling.of(configs))
    propose = jax.jit(lambda cfg: p.propose(**kw, sampling=cfg)[:2], static_argnums=0)  # a SamplingConfig: static
    path, _ = propose(SamplingConfig())  # the argmax path: every greedy-draft row's alone
    for b, cfg in enumerate(configs):
        alone, q_alone = propose(cfg) if cfg.sampled_drafts else (path, None)  # row b of every row with cfg
        np.testing.assert_array_equal(drafts[b], alone[b], err_msg=str(cfg))
        want_q = jax.nn.one_hot(alone[b], V) if q_alone is None else q_alone[b]
        np.testing.assert_allclose(q[b], want_q, atol=1e-6, err_msg=str(cfg))
        assert (np.asarray(drafts[b]) != np.asarray(path[b])).any() == cfg.sampled_drafts, cfg


def test_oracle_proposer_corrupts_the_chosen_offset_and_follows_commits():
    target = _target()
    p = OracleProposer(V)
    continuation = jnp.arange(2 * 10, dtype=jnp.int32).reshape(2, 10) % V
    params = OracleParams(continuation, jnp.array([1, 5], jnp.int32))
    prompts, lens, out = _prefilled(target, ())
    view = TargetView.of(target.params)
    state = p.init(params=params, view=view, prefill=out, prompts=prompts, prompt_lens=lens, capacity=16)
    kw = dict(params=params, view=view, anchor=jnp.zeros(2, jnp.int32), k=3, keys=None, sampling=SamplingConfig())
    drafts, q, state = p.propose(state=state, **kw)
    assert q is None
    # step 0: row 0 uses errors[0] = 1 (offset 1 wrong), row 1 errors[1] = 5 (>= k: no error).
    np.testing.assert_array_equal(drafts, [[1, 3, 3], [11, 12, 13]])
    state = p.commit(params=params, view=view, state=state, verified=out, n=jnp.array([2, 1]))
    drafts, _, _ = p.propose(state=state, **kw)
    # step 1: row 0 errors[1] (none) from position 2; row 1 errors[0] = 1 from position 1.
    np.testing.assert_array_equal(drafts, [[3, 4, 5], [12, 14, 14]])


def test_no_proposer_drafts_nothing_and_keeps_no_state():
    target = _target()
    p = NoProposer()
    prompts, lens, out = _prefilled(target, ())
    view = TargetView.of(target.params)
    assert p.init(params=(), view=view, prefill=out, prompts=prompts, prompt_lens=lens, capacity=16) == ()
    drafts, q, state = p.propose(params=(), view=view, state=(), anchor=jnp.zeros(2, jnp.int32), k=0, keys=None,
                                 sampling=SamplingConfig())
    assert drafts.shape == (2, 0) and q is None and state == ()
    assert p.max_block == 1 and p.taps == ()
