"""The speculative loop: lossless against plain decoding, exact sampling, batching, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import speculative as gen
from dflash_jax.drafter import DrafterConfig, init_drafter
from dflash_jax.proposers import DFlashProposer, NoProposer, OracleParams, OracleProposer
from dflash_jax.sampling import SamplingConfig
from dflash_jax.speculative import SpecConfig, generate, make_generate, pad_prompts, stream
from dflash_jax.target import load_target

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
    return jax.jit(make_generate(target, proposer, spec))((target.params, pparams), tokens, lengths, rng)


def _drafter_for(target, block=8, seed=0):
    cfg = DrafterConfig(hidden_size=target.cfg.hidden_size, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, intermediate_size=48, rms_norm_eps=1e-6,
                        rope_theta=10000.0, vocab_size=target.cfg.vocab_size, block_size=block,
                        mask_token_id=target.cfg.vocab_size - 1, target_layer_ids=(0, 2),
                        num_target_layers=target.cfg.num_hidden_layers,
                        layer_types=("full_attention", "full_attention"), sliding_window=None, is_causal=None,
                        target_hidden_size=target.cfg.hidden_size)
    return init_drafter(cfg, dtype=jnp.float32, seed=seed)


@pytest.mark.parametrize("batch", ["one", "mixed"])
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


def test_block_size_chosen_per_call_without_reloading(hf_dense):
    target = load_target(hf_dense[1], dtype=jnp.float32, progress=False)
    drafter = _drafter_for(target)
    prompts = _prompts(target.cfg.vocab_size, (7,), seed=2)
    ar = generate(target, prompts, max_new_tokens=12, stop_ids=())
    for block in (1, 3, 8):
        out = generate(target, prompts, drafter=drafter, block_size=block, max_new_tokens=12, stop_ids=())
        assert out.texts() == ar.texts()


def test_stop_ids_and_max_new_tokens(hf_dense):
    target = load_target(hf_dense[1], dtype=jnp.float32, progress=False)
    prompts = _prompts(target.cfg.vocab_size, PROMPT_LENS, seed=3)
    ar = generate(target, prompts, max_new_tokens=MAX_NEW, stop_ids=())
    texts = ar.texts()
    stop = texts[1][6]  # a token row 1 emits at index 6 (or earlier)
    out = generate(target, prompts, drafter=_drafter_for(target), block_size=4, max_new_tokens=MAX_NEW,
                   stop_ids=(stop,))
    for full, got, reason in zip(texts, out.texts(), np.asarray(out.finish_reason), strict=True):
        cut = full.index(stop) + 1 if stop in full else len(full)
        assert got == full[:cut]
        assert gen.FINISH_REASONS[int(reason)] == ("stop" if stop in full else "length")
    assert (np.asarray(out.lengths) <= MAX_NEW).all()


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
    assert joined == final.texts() == generate(target, prompts, max_new_tokens=10, stop_ids=()).texts()
    assert len(chunks[0][0]) == 1  # the first token comes straight from prefill


def test_no_recompilation_for_new_prompts_in_the_same_bucket(hf_dense):
    target = load_target(hf_dense[1], dtype=jnp.float32, progress=False)
    gen._compiled.cache_clear()
    generate(target, _prompts(96, (5, 9), seed=5), max_new_tokens=4)
    fn = gen._compiled(target.cfg, target.graphdef, NoProposer(), SpecConfig(block_size=1, max_new_tokens=4))
    generate(target, _prompts(96, (11, 2), seed=6), max_new_tokens=4)
    assert fn._cache_size() == 1


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
