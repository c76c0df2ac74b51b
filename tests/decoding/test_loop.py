"""The speculative loop: lossless against plain decoding, exact sampling, batching, errors."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from exact_stats import chi2_pvalue, exact_joint, sharp_tiny_target, tiny_drafter
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_jax.config import DrafterConfig
from dflash_jax.decoding import loop as gen
from dflash_jax.decoding import sampling
from dflash_jax.decoding.api import bucket_for, generate, make_generate, pad_prompts, position_warning, stream
from dflash_jax.decoding.loop import FinishReason, SpecConfig
from dflash_jax.decoding.proposers import DFlashProposer, NoProposer, OracleParams, OracleProposer
from dflash_jax.decoding.sampling import SamplingConfig
from dflash_jax.models.drafter import init_drafter
from dflash_jax.models.target import init_target, load_target

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # JAX's event for one XLA compilation
MAX_NEW = 24
PROMPT_LENS = (5, 12, 1, 9)


@pytest.fixture(scope="module", params=["dense", "moe"])
def tiny(request):
    _, path = request.getfixturevalue(f"hf_{request.param}")
    return request.param, load_target(path, dtype=jnp.float32, progress=False)


def _prompts(vocab, lens, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lens]


def _run(target, proposer, pparams, prompts, block, max_new=MAX_NEW, sampling=SamplingConfig(), rng=0):
    tokens, lengths = pad_prompts(prompts, 16)
    spec = SpecConfig(block_size=block, max_new_tokens=max_new, sampling=sampling, stop_ids=())
    # Not wrapped in jax.jit: make_generate's loop is jitted and cached per configuration, shared by tests.
    return make_generate(target, proposer, spec)((target.params, pparams), tokens, lengths, rng)


@settings(max_examples=100, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, 95), min_size=1, max_size=40), min_size=1, max_size=6),
       minimum=st.sampled_from([1, 8, 16]))
def test_padding_keeps_every_prompt_in_its_power_of_two_bucket(prompts, minimum):
    longest = max(map(len, prompts))
    bucket = bucket_for(longest, minimum)
    assert bucket >= max(longest, minimum) and bucket & (bucket - 1) == 0  # a power of two that fits
    assert bucket < 2 * max(longest, minimum)  # the smallest one
    tokens, lengths = pad_prompts(prompts, bucket, vocab_size=96)
    assert tokens.shape == (len(prompts), bucket) and tokens.dtype == np.int32
    assert lengths.tolist() == [len(p) for p in prompts]
    for row, p in zip(tokens, prompts, strict=True):
        assert row[:len(p)].tolist() == p and not row[len(p):].any()


def _drafter_for(target, block=8, seed=0):
    cfg = DrafterConfig(hidden_size=target.cfg.hidden_size, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, intermediate_size=48, rms_norm_eps=1e-6,
                        rope_theta=10000.0, vocab_size=target.cfg.vocab_size, block_size=block,
                        mask_token_id=target.cfg.vocab_size - 1, target_layer_ids=(0, 2),
                        num_target_layers=target.cfg.num_hidden_layers,
                        layer_types=("full_attention", "full_attention"), sliding_window=None, is_causal=None,
                        target_hidden_size=target.cfg.hidden_size)
    return init_drafter(cfg, dtype=jnp.float32, seed=seed)


@pytest.mark.parametrize("batch", [pytest.param("one", marks=pytest.mark.slow), "mixed"])
def test_greedy_oracle_lossless_every_acceptance_count(tiny, batch):
    kind, target = tiny
    lens = PROMPT_LENS if batch == "mixed" else PROMPT_LENS[:1]
    prompts = _prompts(target.cfg.vocab_size, lens)
    max_new = 140  # enough steps for errors at every offset 0..15 of a 16-block
    ar = _run(target, NoProposer(), (), prompts, 1, max_new=max_new)
    assert (np.asarray(ar.lengths) == max_new).all() and (np.asarray(ar.steps) == max_new - 1).all()
    continuation = jnp.pad(ar.tokens, ((0, 0), (0, 16)))
    blocks = (2, 4, 8, 16) if (kind, batch) == ("dense", "mixed") else (4, 16)
    for block in blocks:
        k = block - 1
        params = OracleParams(continuation, jnp.arange(k + 1, dtype=jnp.int32))  # errors at 0..k-1, then none
        out = _run(target, OracleProposer(target.cfg.vocab_size), params, prompts, block, max_new=max_new)
        np.testing.assert_array_equal(out.tokens, ar.tokens, err_msg=f"block {block}")
        assert (np.asarray(out.accepted).sum(0) > 0).all(), f"block {block}: not every count 0..{k} occurred"
        assert (np.asarray(out.steps) < np.asarray(ar.steps)).all()


def test_greedy_random_drafter_lossless(tiny):
    _, target = tiny
    prompts = _prompts(target.cfg.vocab_size, PROMPT_LENS, seed=1)
    drafter = _drafter_for(target)
    ar = _run(target, NoProposer(), (), prompts, 1)
    out = _run(target, DFlashProposer(drafter.cfg, drafter.graphdef), drafter.params, prompts, 8)
    np.testing.assert_array_equal(out.tokens, ar.tokens)


@pytest.mark.slow
def test_block_size_chosen_per_call_without_reloading(hf_dense):
    target = load_target(hf_dense[1], dtype=jnp.float32, progress=False)
    drafter = _drafter_for(target)
    prompts = _prompts(target.cfg.vocab_size, (7,), seed=2)
    ar = generate(target, prompts, max_new_tokens=12, stop_ids=())
    for block in (1, 3, 8):
        out = generate(target, prompts, drafter=drafter, block_size=block, max_new_tokens=12, stop_ids=())
        assert out.token_lists() == ar.token_lists()


@pytest.mark.slow
def test_stop_ids_and_max_new_tokens(hf_dense):
    target = load_target(hf_dense[1], dtype=jnp.float32, progress=False)
    prompts = _prompts(target.cfg.vocab_size, PROMPT_LENS, seed=3)
    ar = generate(target, prompts, max_new_tokens=MAX_NEW, stop_ids=())
    texts = ar.token_lists()
    stop = texts[1][6]  # a token row 1 emits at index 6 (or earlier)
    out = generate(target, prompts, drafter=_drafter_for(target), block_size=4, max_new_tokens=MAX_NEW,
                   stop_ids=(stop,))
    for full, got, reason in zip(texts, out.token_lists(), np.asarray(out.finish_reason), strict=True):
        cut = full.index(stop) + 1 if stop in full else len(full)
        assert got == full[:cut]
        assert FinishReason(int(reason)) == (FinishReason.STOP if stop in full else FinishReason.LENGTH)
    assert out.finish_names() == ["stop" if stop in full else "length" for full in texts]
    assert (np.asarray(out.lengths) <= MAX_NEW).all()


@pytest.mark.slow
def test_stream_yields_the_generated_tokens(hf_dense):
    target = load_target(hf_dense[1], dtype=jnp.float32, progress=False)
    prompts = _prompts(target.cfg.vocab_size, (3, 8), seed=4)
    drafter = _drafter_for(target)
    chunks = []
    it = stream(target, prompts, drafter=drafter, block_size=4, max_new_tokens=10, stop_ids=())
    try:
        while True:
            chunks.append(next(it))
    except StopIteration as done:
        final = done.value
    joined = [sum((c[b] for c in chunks), []) for b in range(2)]
    assert joined == final.token_lists() == generate(target, prompts, max_new_tokens=10, stop_ids=()).token_lists()
    assert len(chunks[0][0]) == 1  # the first token comes straight from prefill


@contextlib.contextmanager
def _compilations():
    """Collects the XLA compilations JAX reports (its monitoring hook) inside the block."""
    seen = []

    def listener(event, duration, **kwargs):
        if event == BACKEND_COMPILE:
            seen.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def test_no_recompilation_for_new_prompts_in_the_same_bucket(hf_dense):
    target = load_target(hf_dense[1], dtype=jnp.float32, progress=False)
    generate(target, _prompts(96, (5, 9), seed=5), max_new_tokens=4)
    fn = gen.SpeculativeLoop.run
    size = fn._cache_size()
    with _compilations() as seen:
        generate(target, _prompts(96, (11, 2), seed=6), max_new_tokens=4)
    assert fn._cache_size() == size and seen == []
    with _compilations() as seen:  # the counter counts: a new shape compiles
        generate(target, _prompts(96, (11, 2), seed=6), max_new_tokens=5)
    assert seen


@pytest.mark.slow
def test_second_stream_and_generate_compile_nothing(hf_dense):
    """Equal configurations share the compiled phases (the loop is static and hashable): the second
    stream() and generate() with the same shapes, even from a reloaded target, compile nothing."""
    target = load_target(hf_dense[1], dtype=jnp.float32, progress=False)
    drafter = _drafter_for(target, block=4)
    kw = dict(drafter=drafter, block_size=4, max_new_tokens=6, stop_ids=())
    first = list(stream(target, _prompts(96, (3, 8), seed=7), **kw)), generate(target, _prompts(96, (3, 8)), **kw)
    again = load_target(hf_dense[1], dtype=jnp.float32, progress=False)
    with _compilations() as seen:
        chunks = list(stream(again, _prompts(96, (3, 8), seed=7), **kw))
        out = generate(again, _prompts(96, (3, 8)), **kw)
    assert seen == []
    assert chunks == first[0] and out.token_lists() == first[1].token_lists()


def test_bad_inputs_are_clear_errors(hf_dense):
    target = load_target(hf_dense[1], dtype=jnp.float32, progress=False)
    drafter = _drafter_for(target, block=4)
    with pytest.raises(ValueError, match="empty prompt at row 1"):
        generate(target, [[1, 2], []])
    with pytest.raises(ValueError, match="exceeds the proposer's block size 4"):
        generate(target, [[1, 2]], drafter=drafter, block_size=8)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        SamplingConfig(temperature=-0.5)
    for top_p in (0.0, 1.5):
        with pytest.raises(ValueError, match="top_p must be in"):
            SamplingConfig(temperature=1.0, top_p=top_p)
    spec = SpecConfig(block_size=1, max_new_tokens=64, capacity=32)
    with pytest.raises(ValueError, match="cache capacity 32 is too small"):
        make_generate(target, NoProposer(), spec)((target.params, ()), *pad_prompts([[1, 2, 3]], 16), 0)
    with pytest.raises(ValueError, match="needs a drafter"):
        make_generate(target, NoProposer(), SpecConfig(block_size=4))


def test_token_ids_outside_the_vocabulary_are_refused(hf_dense):
    target = load_target(hf_dense[1], dtype=jnp.float32, progress=False)
    V = target.cfg.vocab_size
    for bad in (V, -1, V + 1000):
        with pytest.raises(ValueError, match=f"prompt 1: token id {bad} is outside the vocabulary \\[0, {V}\\)"):
            generate(target, [[1, 2], [3, bad]])
        with pytest.raises(ValueError, match=f"token id {bad} is outside the vocabulary"):
            next(stream(target, [[3, bad]]))
        with pytest.raises(ValueError, match=f"token id {bad} is outside the vocabulary"):
            pad_prompts([[bad]], vocab_size=V)
        tokens, lengths = pad_prompts([[1, 2, 3]], 16)
        tokens[0, 1] = bad
        with pytest.raises(ValueError, match=f"prompt 0: token id {bad} is outside the vocabulary"):
            make_generate(target, NoProposer(), SpecConfig(block_size=1, max_new_tokens=2))(
                (target.params, ()), tokens, lengths, 0)
    with pytest.raises(ValueError, match="token ids must be a flat list of integers"):
        pad_prompts([[1, 2.5]])
    tokens, lengths = pad_prompts([[1, 2, 3]], 16)
    tokens[0, 5] = V  # padding past the row's length is never read
    make_generate(target, NoProposer(), SpecConfig(block_size=1, max_new_tokens=2))((target.params, ()), tokens,
                                                                                     lengths, 0)


def test_prompt_lens_are_validated(hf_dense):
    target = load_target(hf_dense[1], dtype=jnp.float32, progress=False)
    fn = make_generate(target, NoProposer(), SpecConfig(block_size=1, max_new_tokens=2))
    tokens, _ = pad_prompts([[1, 2, 3], [4]], 16)
    for lens, message in (([3, 0], r"prompt_lens\[1\] = 0 is outside 1..16"),
                          ([17, 1], r"prompt_lens\[0\] = 17 is outside 1..16"),
                          ([3], r"prompt_lens \[B\], got \(2, 16\) and \(1,\)")):
        with pytest.raises(ValueError, match=message):
            fn((target.params, ()), tokens, np.array(lens, np.int32), 0)


def test_huge_max_new_tokens_is_refused_not_hung(hf_dense):
    target = load_target(hf_dense[1], dtype=jnp.float32, progress=False)
    with pytest.raises(ValueError, match="max_new_tokens 10000000000 cannot be held: 1 rows of 10000000017 cache "
                                         "positions need .* GiB"):
        generate(target, [[1, 2]], max_new_tokens=10**10)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1, got 10000000000.0"):
        generate(target, [[1, 2]], max_new_tokens=1e10)


def test_the_cache_is_a_multiple_of_128_positions_on_a_tpu_only(hf_dense, monkeypatch):
    """On a TPU the V cache is tiled by 128 along its positions; another length costs a copy of the whole cache."""
    target = load_target(hf_dense[1], dtype=jnp.float32, progress=False)
    loop = gen.SpeculativeLoop.of(target, NoProposer(), SpecConfig(block_size=1, max_new_tokens=20))
    assert loop.capacity(1, 16, jnp.float32) == 16 + 20 + 1
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert loop.capacity(1, 16, jnp.float32) == 128
    assert gen.tile_capacity(256, "tpu") == 256 and gen.tile_capacity(257, "tpu") == 384
    given = gen.SpeculativeLoop.of(target, NoProposer(), SpecConfig(block_size=1, max_new_tokens=20, capacity=40))
    assert given.capacity(1, 16, jnp.float32) == 40  # a capacity the caller gave is kept


def test_warns_past_max_position_embeddings(hf_dense):
    target = load_target(hf_dense[1], dtype=jnp.float32, progress=False)
    short = dataclasses.replace(target, cfg=dataclasses.replace(target.cfg, max_position_embeddings=20))
    tokens, lengths = pad_prompts([[1, 2]], 16)

    def trace(max_new):  # the check runs when the loop is traced: no need to compile or run it
        fn = make_generate(short, NoProposer(), SpecConfig(block_size=1, max_new_tokens=max_new, stop_ids=()))
        jax.eval_shape(fn, (short.params, ()), tokens, lengths, 0)

    # The real lengths decide, not the bucket: 2 tokens (bucket 16) + 8 fit in 20; concrete prompts are checked
    # as they are given (api._inputs; tests/decoding/test_api_checks.py), a traced call warns of nothing.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trace(8)
    assert position_warning(short.cfg, lengths, 8) is None
    assert "the longest prompt (2 tokens) + max_new_tokens 19 = 21 exceeds the target's max_position_embeddings " \
           "20" in position_warning(short.cfg, lengths, 19)


def _with_nan_embedding(target, token):
    """The target with the embedding row of ``token`` NaN: its logits turn non-finite once it is processed."""
    flat = [(p, v.replace(v.get_value().at[token].set(jnp.nan))) if p == ("model", "embed_tokens", "weight")
            else (p, v) for p, v in nnx.to_flat_state(target.params)]
    return dataclasses.replace(target, params=nnx.from_flat_state(flat))


@pytest.mark.slow
def test_nonfinite_logits_finish_the_row_as_nonfinite(hf_dense):
    """NaN weights: the row emits only tokens finite logits decided (plain decoding's), then stops NONFINITE.

    Plain decoding emits exactly the tokens up to the poisoned one. A verify block holding it may turn
    the whole block's logits non-finite (the chunked delta rule mixes its positions), so speculation
    may stop earlier, but never emits a token plain decoding would not."""
    target = load_target(hf_dense[1], dtype=jnp.float32, progress=False)
    prompts = _prompts(target.cfg.vocab_size, (6,), seed=9)
    ar = _run(target, NoProposer(), (), prompts, 1).token_lists()[0]
    cut = next(i for i in range(2, MAX_NEW) if ar[i] not in prompts[0] + ar[:i])
    bad = _with_nan_embedding(target, ar[cut])
    continuation = jnp.pad(jnp.asarray([ar]), ((0, 0), (0, 16)))
    drafter = _drafter_for(target, block=4)
    runs = {"plain": (NoProposer(), (), 1),
            "dflash": (DFlashProposer(drafter.cfg, drafter.graphdef), drafter.params, 4),
            "oracle": (OracleProposer(target.cfg.vocab_size), OracleParams(continuation, jnp.array([99])), 4)}
    for name, (proposer, pparams, block) in runs.items():
        out = _run(bad, proposer, pparams, prompts, block)
        got = out.token_lists()[0]
        assert got == ar[:cut + 1] if name == "plain" else (got == ar[:len(got)] and len(got) <= cut + 1), name
        assert out.finish_names() == ["nonfinite"] and int(out.finish_reason[0]) == FinishReason.NONFINITE, name
    out = _run(_with_nan_embedding(target, jnp.arange(target.cfg.vocab_size)), NoProposer(), (), prompts, 1)
    assert out.finish_names() == ["nonfinite"] and int(out.lengths[0]) == 0 and (np.asarray(out.tokens) == -1).all()


def test_top_k_beyond_the_vocabulary_is_refused(hf_dense):
    target = load_target(hf_dense[1], dtype=jnp.float32, progress=False)
    with pytest.raises(ValueError, match="top_k 97 exceeds the target's vocabulary of 96"):
        generate(target, [[1, 2]], sampling=SamplingConfig(temperature=1.0, top_k=97))


# ---- sampling through the loop: the exact distribution of plain sampling, and batching ----

V = 8


# Sampled drafts (q from the drafter) run by default in test_dflash2's exact-distribution test (the selector's q).
@pytest.mark.parametrize("mode", ["greedy", pytest.param("sampled", marks=pytest.mark.slow)])
def test_speculative_sampling_matches_exact_distribution(mode, monkeypatch):
    target = sharp_tiny_target(V)
    drafter = tiny_drafter(V)
    dcfg = drafter.cfg
    cfg = SamplingConfig(temperature=1.0, draft_mode=mode)
    prompt = np.array([1, 5, 2], np.int32)
    exact = exact_joint(target, prompt, cfg)
    N = 6000
    spec = SpecConfig(block_size=3, max_new_tokens=3, sampling=cfg, stop_ids=())
    tokens, lengths = pad_prompts([prompt.tolist()] * N, 4)

    def sample_joint(spec):
        fn = jax.jit(make_generate(target, DFlashProposer(dcfg, drafter.graphdef), spec))
        out = fn((target.params, drafter.params), tokens, lengths, jax.random.key(7))
        seqs = np.asarray(out.tokens)
        assert (np.asarray(out.steps) >= 1).all()
        return np.bincount(np.ravel_multi_index(seqs.T, (V,) * 3), minlength=V**3)

    counts = sample_joint(spec)
    # Compare the marginals of the 2nd and 3rd token (decided by the acceptance rule) and their joint.
    joint3 = exact.reshape(V, V, V)
    c3 = counts.reshape(V, V, V)
    assert chi2_pvalue(c3.sum((0, 2)), joint3.sum((0, 2))) > 1e-4
    assert chi2_pvalue(c3.sum((0, 1)), joint3.sum((0, 1))) > 1e-4
    assert chi2_pvalue(c3.sum(0).ravel(), joint3.sum(0).ravel()) > 1e-4

    # The same statistic rejects a wrong rule (always accept the drafts): the test has power.
    def accept_all(drafts, q, logits, keys, scfg):
        a = jnp.full(drafts.shape[:1], drafts.shape[1], jnp.int32)
        return a, sampling.choose(logits[:, -1], keys, scfg)

    monkeypatch.setattr(gen, "accept", accept_all)
    # Equal configurations share compiled programs: another capacity makes one that traces the patched rule.
    wrong = sample_joint(dataclasses.replace(spec, capacity=11)).reshape(V, V, V)
    assert chi2_pvalue(wrong.sum(0).ravel(), joint3.sum(0).ravel()) < 1e-6


def _row_batch(target, drafter, configs, prompts, keys, max_new, bucket=8):
    """The loop on every prompt once per config in one batch (per-row rules, ``RowSampling``, the server's
    path), row i * len(prompts) + j: config i, prompt j, key j."""
    spec = SpecConfig(block_size=drafter.cfg.block_size, max_new_tokens=max_new, stop_ids=())
    loop = gen.SpeculativeLoop.of(target, DFlashProposer(drafter.cfg, drafter.graphdef), spec)
    tokens, lengths = pad_prompts([p for _ in configs for p in prompts], bucket)
    rows = sampling.RowSampling.of([c for c in configs for _ in prompts])
    params = (target.params, drafter.params)
    state = loop.init(params, jnp.asarray(tokens), jnp.asarray(lengths), jnp.concatenate([keys] * len(configs)), rows)
    return loop.decode(params, state)[0]


MIXED = (SamplingConfig(1.0), SamplingConfig(1.0, draft_mode="greedy"), SamplingConfig(0.0))


# By default tests/serve/test_engine.py's seeded request (= generate, both drafting sampled) guards the loop's
# per-row drafts, and test_row_sampling each row's draft mode.
@pytest.mark.slow
def test_a_mixed_row_batch_drafts_each_row_by_its_mode_as_generate_does():
    """Sampled-draft (the default), greedy-draft and greedy rows in one per-row batch, on the same prompts and
    keys: the sampled-draft rows' tokens are ``generate``'s with their config (whose sampled drafts the
    exact-distribution tests cover), and the greedy-draft rows' differ from them, so a row drafting by the
    wrong mode shows."""
    target, drafter = sharp_tiny_target(V, sharpness=10.0), tiny_drafter(V)  # p neither uniform nor one-hot
    prompts = [[1, 5, 2], [3, 3], [6, 1, 4, 2], [2]]
    keys = jax.random.split(jax.random.key(5), len(prompts))
    n = len(prompts)
    batch = _row_batch(target, drafter, MIXED, prompts, keys, max_new=8).token_lists()
    spec = SpecConfig(block_size=3, max_new_tokens=8, sampling=MIXED[0], stop_ids=())
    alone = make_generate(target, DFlashProposer(drafter.cfg, drafter.graphdef), spec)(
        (target.params, drafter.params), *pad_prompts(prompts, 8), keys).token_lists()
    assert batch[:n] == alone
    assert batch[n:2 * n] != alone


@pytest.mark.slow
def test_a_mixed_row_batch_samples_each_rows_exact_distribution():
    """6000 rows, sampled drafts and greedy drafts alternating in one per-row batch: each half's first three
    tokens follow plain sampling's exact joint law."""
    target, drafter = sharp_tiny_target(V), tiny_drafter(V)
    configs = MIXED[:2]
    prompt = np.array([1, 5, 2], np.int32)
    exact = exact_joint(target, prompt, configs[0]).reshape(V, V, V)
    N = 3000
    out = _row_batch(target, drafter, configs, [prompt.tolist()] * N, jax.random.split(jax.random.key(7), N),
                     max_new=3, bucket=4)
    seqs = np.asarray(out.tokens)
    for i, cfg in enumerate(configs):
        rows = seqs[i * N:(i + 1) * N]
        c3 = np.bincount(np.ravel_multi_index(rows.T, (V,) * 3), minlength=V**3).reshape(V, V, V)
        assert chi2_pvalue(c3.sum((0, 2)), exact.sum((0, 2))) > 1e-4, cfg
        assert chi2_pvalue(c3.sum((0, 1)), exact.sum((0, 1))) > 1e-4, cfg
        assert chi2_pvalue(c3.sum(0).ravel(), exact.sum(0).ravel()) > 1e-4, cfg


def test_batch_row_equals_the_prompt_run_alone():
    target = sharp_tiny_target(V)
    keys = jax.random.split(jax.random.key(11), 3)
    prompts = [[1, 2, 3], [4, 5], [6, 1, 1, 2]]
    spec = SpecConfig(block_size=1, max_new_tokens=6, sampling=SamplingConfig(temperature=1.0), stop_ids=())
    fn = jax.jit(make_generate(target, NoProposer(), spec))
    batch = fn((target.params, ()), *pad_prompts(prompts, 8), keys)
    alone = fn((target.params, ()), *pad_prompts(prompts[1:2], 8), keys[1:2])
    assert batch.token_lists()[1] == alone.token_lists()[0]


# ---- review fixes: argument normalisation, donation, streaming copies ----


def test_stop_ids_are_normalised_to_a_tuple_of_ints():
    for given_ids in ([1, 2], np.array([1, 2]), (np.int64(1), np.int32(2)), range(1, 3)):
        spec = SpecConfig(block_size=1, stop_ids=given_ids)
        assert spec.stop_ids == (1, 2) and all(type(t) is int for t in spec.stop_ids)
        hash(spec)
    assert SpecConfig(stop_ids=5).stop_ids == (5,) and SpecConfig(stop_ids=[]).stop_ids == ()
    for bad in ([1.5], ["a"], [True], [-1], 2.0):
        with pytest.raises(ValueError, match="stop_ids must be"):
            SpecConfig(stop_ids=bad)
    target = sharp_tiny_target(V)
    out = generate(target, [[1, 2, 3]], max_new_tokens=4, stop_ids=[V - 1, 0])
    assert len(out.token_lists()[0]) >= 1
    with pytest.raises(ValueError, match=f"stop_ids: token id {V} is outside the target's vocabulary \\[0, {V}\\)"):
        generate(target, [[1, 2, 3]], max_new_tokens=4, stop_ids=[1, V])


def test_decode_donates_the_state_into_its_final_state():
    """decode's donated state aliases its returned final state: no "donated buffers were not usable"
    warning, the caches are updated in place (input_output_alias), the input state's buffers are gone."""
    target = sharp_tiny_target(V)
    loop = gen.SpeculativeLoop.of(target, NoProposer(), SpecConfig(block_size=1, max_new_tokens=4, stop_ids=()))
    params, (tokens, lengths) = (target.params, ()), pad_prompts([[1, 2, 3], [4]], 8)
    state = loop.init(params, tokens, lengths, 0)
    hlo = gen.SpeculativeLoop.decode.lower(loop, params, state).compile().as_text()
    assert "input_output_alias" in hlo
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, final = loop.decode(params, state)
    assert all(x.is_deleted() for x in jax.tree.leaves(state.cache))
    assert out.token_lists() == loop.run(params, tokens, lengths, 0).token_lists()
    assert isinstance(final, gen.LoopState) and (np.asarray(final.n_out) == 4).all()


@pytest.mark.slow
def test_stream_copies_a_block_per_step_not_the_whole_output(monkeypatch):
    """stream() copies n_out, finish and a [B, block] window per step (not the [B, max_new + block]
    buffer: O(n) over a generation), gathered by parallel.host, as finish_names() is."""
    from dflash_jax import parallel

    target, copied = sharp_tiny_target(V), []

    def host(tree):
        copied.append([np.shape(x) for x in jax.tree.leaves(tree)])
        return real(tree)

    real = parallel.host
    monkeypatch.setattr(parallel, "host", host)
    prompts, max_new = [[1, 2, 3], [4, 5]], 20
    proposer = OracleProposer(V)
    continuation = jnp.asarray(generate(target, prompts, max_new_tokens=max_new, stop_ids=()).tokens)
    drafter = (proposer, OracleParams(jnp.pad(continuation, ((0, 0), (0, 8))), jnp.array([3, 99])))
    for block, kw in ((1, {}), (4, dict(drafter=drafter))):
        copied.clear()
        it = stream(target, prompts, block_size=block, max_new_tokens=max_new, stop_ids=(), **kw)
        chunks = list(it)
        assert [sum((c[b] for c in chunks), []) for b in range(2)] == continuation.tolist()
        assert len(copied) == len(chunks) and all(s in ((2,), (2, block)) for c in copied for s in c)
    copied.clear()
    assert generate(target, prompts, max_new_tokens=2, stop_ids=()).finish_names() == ["length", "length"]
    assert copied == [[(2,)]]


def test_bad_rng_is_a_clear_error():
    target = sharp_tiny_target(V)
    prompts = [[1, 2, 3], [4, 5]]
    for rng, message in ((jax.random.split(jax.random.key(0), 3), r"rng: a batch of keys needs one key per row, "
                                                                   r"got shape \(3,\) for 2 rows"),
                         (np.zeros((3, 2), np.uint32), r"got shape \(3,\) for 2 rows"),
                         (1.5, "rng must be an int seed or a jax.random key"),
                         (np.zeros((2, 3), np.uint32), "rng must be an int seed")):
        with pytest.raises(ValueError, match=message):
            generate(target, prompts, max_new_tokens=2, rng=rng)
    keys = jax.random.split(jax.random.key(0), 2)
    assert generate(target, prompts, max_new_tokens=2, rng=keys).token_lists() == \
        generate(target, prompts, max_new_tokens=2, rng=jax.random.key_data(keys)).token_lists()


def test_memory_check_counts_the_proposer_state_and_splits_rows_over_the_data_axis(monkeypatch):
    target = sharp_tiny_target(V)
    cfg = DrafterConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                        head_dim=8, intermediate_size=24, vocab_size=V, block_size=4, mask_token_id=V - 1,
                        target_layer_ids=(0, 1), num_target_layers=2, target_hidden_size=16)
    drafter = init_drafter(cfg)
    tokens, lengths = pad_prompts([[1, 2, 3], [4, 5], [6], [7, 1]], 8)
    spec = SpecConfig(block_size=4, max_new_tokens=64, stop_ids=())
    capacity = 8 + 64 + 4
    target_only = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(
        lambda: gen.init_cache(target.cfg, 4, capacity, jnp.float32)))) + 4 * (64 + 4) * 4
    asked = []
    monkeypatch.setattr(gen, "_memory_bytes", lambda device: asked.append(device) or target_only)

    def check(proposer, pparams, s=spec):  # what a concrete call checks before it allocates (nothing compiled)
        gen.SpeculativeLoop.of(target, proposer, s).check_memory((target.params, pparams), tokens, lengths)

    check(NoProposer(), (), dataclasses.replace(spec, block_size=1, capacity=capacity))
    assert asked == [next(iter(jax.tree.leaves(target.params)[0].devices()))]  # the device the params are on
    with pytest.raises(ValueError, match=r"max_new_tokens 64 cannot be held: 4 rows of 76 cache positions need "
                                         r".* GiB for the caches and the output alone, more than the memory"):
        check(DFlashProposer(drafter.cfg, drafter.graphdef), drafter.params)
    with pytest.raises(ValueError, match="cannot be held"):  # a concrete call checks before it compiles
        make_generate(target, DFlashProposer(drafter.cfg, drafter.graphdef), spec)(
            (target.params, drafter.params), tokens, lengths, 0)
    # Tracing allocates nothing: eval_shape (and lowering for another device) checks no memory.
    jax.eval_shape(make_generate(target, DFlashProposer(drafter.cfg, drafter.graphdef), spec),
                   (target.params, drafter.params), tokens, lengths, 0)
    # On a mesh the rows are split over the data axis (when it divides them): half the bytes per device.
    monkeypatch.setattr(gen, "_memory_bytes", lambda device: target_only // 2 + 1)
    caches = jax.eval_shape(lambda: gen.init_cache(target.cfg, 4, capacity, jnp.float32))
    mesh = jax.sharding.AbstractMesh((2, 1, 1), ("data", "model", "expert"))
    loop = gen.SpeculativeLoop.of(target, spec=dataclasses.replace(spec, block_size=1))
    device = jax.devices()[0]
    with pytest.raises(ValueError, match="cannot be held"):
        loop._check_held(4, capacity, caches, device)
    dataclasses.replace(loop, mesh=mesh)._check_held(4, capacity, caches, device)
    with pytest.raises(ValueError, match="cannot be held"):  # 3 rows do not split over 2: replicated
        dataclasses.replace(loop, mesh=mesh)._check_held(3, capacity, caches, device)


def test_memory_is_read_from_the_device_not_the_host():
    """A compile-only device reports no memory (nothing to check), a CPU device the host's RAM."""
    class CompileOnly:
        platform = "tpu"

        def memory_stats(self):
            return None

    assert gen._memory_bytes(CompileOnly()) is None
    assert gen._memory_bytes(jax.devices("cpu")[0]) > 2**20


@pytest.mark.slow
def test_every_entry_point_checks_and_places_its_inputs_one_way(monkeypatch):
    """generate, stream and make_generate's function refuse the same bad token id with the same message and,
    on a mesh, place params and rows through the same call (parallel.shard_params / shard_rows), with
    the output of the run without a mesh; a traced prompt batch (the caller's jit) is left to the trace."""
    from dflash_jax import parallel

    target, placed = sharp_tiny_target(V), []
    real_params, real_rows = parallel.shard_params, parallel.shard_rows
    monkeypatch.setattr(parallel, "shard_params", lambda *a: placed.append("params") or real_params(*a))
    monkeypatch.setattr(parallel, "shard_rows", lambda *a: placed.append("rows") or real_rows(*a))
    mesh = parallel.make_mesh(devices=jax.devices()[:1])
    prompts, kw = [[1, 2, 3], [4, 5]], dict(max_new_tokens=3, stop_ids=())
    spec = SpecConfig(block_size=1, **kw)
    runs = {"generate": lambda p, **m: generate(target, p, **kw, **m).token_lists(),
            "stream": lambda p, **m: [sum(c, []) for c in zip(*stream(target, p, **kw, **m), strict=True)],
            "make_generate": lambda p, **m: make_generate(target, NoProposer(), spec, **m)(
                (target.params, ()), *pad_prompts(p, 8), 0).token_lists()}
    for name, run in runs.items():
        with pytest.raises(ValueError, match=f"prompt 1: token id {V} is outside the vocabulary \\[0, {V}\\)"):
            run([[1, 2], [3, V]], mesh=mesh)
        placed.clear()
        assert run(prompts, mesh=mesh) == run(prompts), name
        assert placed == ["params", "rows"], name
    placed.clear()
    tokens, lengths = pad_prompts([[1, 2, 3]], 8)
    tokens[0, 1] = V  # traced: the ids cannot be read, nothing is placed (the caller's jit places them)
    jax.eval_shape(make_generate(target, NoProposer(), spec, mesh=mesh), (target.params, ()), tokens, lengths, 0)
    assert placed == []


def _vocabulary_reductions(fn, *args, vocab):
    """The reductions over a [..., vocab] operand's last axis in fn's jaxpr (sub-jaxprs included)."""
    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            for sub in jax.core.jaxprs_in_params(eqn.params):
                yield from walk(sub)
            axes = eqn.params.get("axes", ())
            shape = getattr(eqn.invars[0].aval, "shape", ()) if eqn.invars else ()
            if eqn.primitive.name.startswith(("reduce_", "argm")) and shape and shape[-1] == vocab \
                    and len(shape) - 1 in axes:
                yield eqn.primitive.name
    return list(walk(jax.make_jaxpr(fn)(*args).jaxpr))


def test_the_finiteness_check_reads_the_peak_and_costs_greedy_no_pass_over_the_vocabulary():
    """A row is non-finite when its logits' peak after the temperature is not finite: a NaN anywhere, a +inf,
    or all -inf (a -inf beside a finite peak is a token of probability 0, not an error). Greedy reads the
    peak at the argmax its rule chose, so the greedy step makes no pass over the vocabulary beyond the
    acceptance rule's; sampling makes one (a max)."""
    # A vocabulary of 37, a size no other axis has, so that the reductions over it can be told apart.
    target = init_target(dataclasses.replace(sharp_tiny_target(V).cfg, vocab_size=37), seed=3)
    x = np.tile(np.linspace(-3.0, 3.0, 37, dtype=np.float32), (6, 1))
    x[1, 5], x[2, 7], x[3], x[4, 2], x[5, 9] = np.nan, np.inf, -np.inf, -np.inf, 3e38
    tokens, lengths = pad_prompts([[1, 2, 3], [4, 5]], 8)
    params = (target.params, OracleParams(jnp.zeros((2, 16), jnp.int32), jnp.array([1])))
    for temperature, want, extra in ((0.0, [True, False, False, False, True, True], {}),
                                     (0.5, [True, False, False, False, True, False], {"reduce_max": 1})):
        spec = SpecConfig(block_size=4, max_new_tokens=6, stop_ids=(), sampling=SamplingConfig(temperature))
        loop = gen.SpeculativeLoop.of(target, OracleProposer(37), spec)
        # 3e38 / 0.5 overflows: not a finite peak when sampling.
        np.testing.assert_array_equal(loop._finite(jnp.asarray(x), jnp.argmax(jnp.asarray(x), -1)), want)
        state = loop.init(params, tokens, lengths, 0)
        draft = loop.draft(params, state)
        verified = loop.check(params, state, draft)
        settle = _vocabulary_reductions(loop.settle, params, state, draft, verified, vocab=37)
        rule = _vocabulary_reductions(functools.partial(sampling.accept, cfg=spec.sampling), draft.tokens, draft.q,
                                      verified.out.logits, draft.accept_keys, vocab=37)
        assert collections.Counter(settle) - collections.Counter(rule) == collections.Counter(extra), (settle, rule)
