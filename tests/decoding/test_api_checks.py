"""API misuse gets a ValueError naming the argument before anything is traced (issue 25): token ids outside
int32, a flat list as prompts, text as prompts, sampling= a dict, a Target as drafter=, rng="abc", parameter
dtypes the model cannot hold, a temperature whose 1/T overflows float32."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from train_fixtures import tiny_target

from dflash_jax.decoding.api import generate, pad_prompts, stream
from dflash_jax.decoding.sampling import SamplingConfig


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.mark.parametrize("ids", [[2**32 + 5], [2**31], [-1], [2**70]])
def test_token_ids_outside_int32_are_refused_not_wrapped(ids):
    with pytest.raises(ValueError, match=r"prompt 0: token id.*int32"):
        pad_prompts([[1, *ids]])
    tokens, _ = pad_prompts([[1, 2**31 - 1]])  # the largest int32 id is kept exactly
    assert tokens[0, 1] == 2**31 - 1


@pytest.mark.parametrize("call", [generate, lambda *a, **k: next(stream(*a, **k))])
@pytest.mark.parametrize("kwargs, prompts, match", [
    ({}, [[1, 2**32 + 5]], r"token id 4294967301 is outside"),
    ({}, [1, 2, 3], r"prompts must be a list of token-id lists, but prompt 0 is the single value 1"),
    ({}, "hello", "prompts must be a list of token-id lists, got str"),
    ({}, ["hello"], "prompt 0 is text"),
    (dict(sampling={"temperature": 0.7}), [[1]], "sampling must be a SamplingConfig"),
    (dict(rng="abc"), [[1]], "rng must be an int seed or a jax.random key"),
    (dict(rng=2**40), [[1]], "rng seed 1099511627776 is outside int32"),
    (dict(max_new_tokens=0), [[1]], "max_new_tokens must be an integer >= 1"),
    (dict(block_size="4"), [[1]], "block_size must be an integer >= 1"),
])
def test_api_misuse_is_named(target, call, kwargs, prompts, match):
    with pytest.raises(ValueError, match=match):
        call(target, prompts, **kwargs)


def test_a_target_as_drafter_or_as_anything_else(target):
    with pytest.raises(ValueError, match="drafter= got a Target"):
        generate(target, [[1]], drafter=target)
    with pytest.raises(ValueError, match="drafter must be a Drafter, a \\(proposer, proposer params\\) pair or None"):
        generate(target, [[1]], drafter="drafter/")
    with pytest.raises(ValueError, match="target must be a Target"):
        generate("target/", [[1]])


def test_temperature_whose_inverse_overflows_float32_is_refused_at_configuration():
    with np.errstate(over="ignore"):
        assert not np.isfinite(np.float32(1) / np.float32(1e-39))  # the overflow being refused
    with pytest.raises(ValueError, match="temperature 1e-39 is too small"):
        SamplingConfig(temperature=1e-39)
    SamplingConfig(temperature=1e-6)


@pytest.mark.parametrize("dtype, match", [(jnp.int8, "int8 is not supported"), ("float16", "float16 is not supported"),
                                          ("nonsense", "is not a dtype")])
def test_load_target_refuses_parameter_dtypes_it_cannot_hold(tmp_path, dtype, match):
    from dflash_jax.models.target import load_target

    with pytest.raises(ValueError, match=match):
        load_target(tmp_path, dtype=dtype)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=rf"{tmp_path / 'config.json'} is a file; a checkpoint is the directory"):
        load_target(tmp_path / "config.json")


def test_the_position_warning_uses_real_lengths_not_the_bucket(target):
    """max_position_embeddings 64: a 20-token prompt (bucket 32) + 40 new tokens fits; 30 + 50 does not."""
    import dataclasses
    import warnings

    from dflash_jax.decoding.api import PositionWarning

    short = dataclasses.replace(target, cfg=dataclasses.replace(target.cfg, max_position_embeddings=64))
    with warnings.catch_warnings():
        warnings.simplefilter("error", PositionWarning)
        generate(short, [[3] * 20], max_new_tokens=40, stop_ids=())
    with pytest.warns(PositionWarning, match=r"the longest prompt \(30 tokens\) \+ max_new_tokens 50 = 80 exceeds"):
        generate(short, [[3] * 30], max_new_tokens=50, stop_ids=())
