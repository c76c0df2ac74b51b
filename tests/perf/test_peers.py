"""Peers on the same weights: transformers' generate (``hf:ar``) and z-lab's dflash package (``zlab:B``) on a tiny
checkpoint transformers wrote, their texts compared with plain decoding's, and the bench's table reporting them."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import pytest
from hf_oracle import tiny_drafter_config

from dflash_jax.decoding.api import generate
from dflash_jax.decoding.sampling import SamplingConfig
from dflash_jax.models.drafter import init_drafter, save_drafter
from dflash_jax.models.target import load_target
from dflash_jax.perf import bench, peers

pytest.importorskip("torch", reason="the peers run in PyTorch")


def _zlab():
    pytest.importorskip("dflash", reason="z-lab's package: pip install --no-deps dflash==0.1.0")

PROMPTS = [[5, 6, 7, 8], [9, 10]]


@pytest.fixture(scope="module")
def pair(hf_dense, tmp_path_factory):
    """(target dir, z-lab-format drafter dir, our target): the tiny transformers checkpoint and a random block-4
    drafter tapping layers 0 and 2 (z-lab's hidden_states[1] and [3])."""
    _, target_dir = hf_dense
    target = load_target(target_dir, dtype=jnp.float32, progress=False)
    cfg = tiny_drafter_config(target.cfg)
    draft_dir = tmp_path_factory.mktemp("peers") / "drafter"
    save_drafter(draft_dir, init_drafter(cfg, dtype=jnp.float32))
    return target_dir, draft_dir, target


def _clock():
    ticks = itertools.count()
    return lambda: float(next(ticks))


@pytest.mark.slow
def test_each_peer_runs_the_checkpoint_and_its_text_is_compared_with_plain_decoding(pair):
    _zlab()
    target_dir, draft_dir, target = pair
    hf, zlab = peers.Peer("hf", 1), peers.Peer("zlab", 4)
    models = peers.Models(target_dir, draft_dir, [hf, zlab])
    ar_out = generate(target, PROMPTS, max_new_tokens=8, stop_ids=())
    ar = ar_out.token_lists()
    outs = {}
    for p in (hf, zlab):
        run = peers.runner(p, models, [PROMPTS], max_new_tokens=8, stop_ids=(), sampling=SamplingConfig())
        out, prefill_s, decode_s = run(0, _clock())
        assert prefill_s > 0 and decode_s > 0  # a fake clock: each split reads at least one tick
        assert [len(t) for t in out.token_lists()] == [8, 8] and out.lengths.tolist() == [8, 8]
        outs[p] = out
    # transformers' own Qwen3.5 greedy decoding is the oracle of ours: the same tokens
    assert outs[hf].token_lists() == ar and outs[hf].tau.tolist() == [1.0, 1.0]
    assert all(1 <= s <= 7 for s in outs[zlab].steps) and (outs[zlab].tau >= 1).all()
    # the comparison the bench makes for every method, whatever z-lab's GDN-cropping does to its text
    same = bench.same_texts([outs[zlab]], [ar_out])
    assert same == [a == b for a, b in zip(outs[zlab].token_lists(), ar, strict=True)]


def test_zlab_peer_runs_under_this_transformers_and_its_rollback_is_exact(pair):
    """transformers >= 5.25 fails in Qwen3.5's forward (min(int, None)) unless the cache is told how many
    Gated DeltaNet states to keep; given them, z-lab's crop rolls the recurrent state back exactly, so its
    greedy text is plain decoding's (a random drafter: most drafts are rejected, so most steps roll back)."""
    _zlab()
    import transformers

    target_dir, draft_dir, target = pair
    zlab = peers.Peer("zlab", 4)
    models = peers.Models(target_dir, draft_dir, [zlab])
    assert any(t == "linear_attention" for t in models.target.config.layer_types)  # the layers the rollback concerns
    ar = generate(target, PROMPTS, max_new_tokens=8, stop_ids=()).token_lists()
    run = peers.runner(zlab, models, [PROMPTS], max_new_tokens=8, stop_ids=(), sampling=SamplingConfig())
    out, _, _ = run(0, _clock())
    assert [len(t) for t in out.token_lists()] == [8, 8]
    assert sum(out.steps) > 2 * 2  # rejections happened: 7 tokens after the first need 2 steps of 4 at best
    if hasattr(transformers.DynamicCache, "get_recurrent_states_to_keep"):
        assert out.token_lists() == ar


def test_peer_names_and_errors():
    assert peers.parse_peer("hf:ar") == peers.Peer("hf", 1) and peers.Peer("hf", 1).name == "hf:ar"
    assert peers.parse_peer(" zlab:16") == peers.Peer("zlab", 16) and peers.Peer("zlab", 16).name == "zlab:16"
    assert peers.parse_peer("dflash:16") is None
    for bad in ("hf:8", "zlab:1", "zlab:x"):
        with pytest.raises(ValueError, match="the peers are hf:ar"):
            peers.parse_peer(bad)


def test_missing_packages_are_one_message_saying_how_to_install(monkeypatch):
    real = peers.importlib.import_module

    def fake(name):
        if name == "dflash":
            raise ImportError(name)
        return real(name)

    monkeypatch.setattr(peers.importlib, "import_module", fake)
    peers.require([peers.Peer("hf", 1)])  # hf needs no dflash
    with pytest.raises(ValueError, match=r"zlab:16 need dflash: pip install --no-deps dflash==0.1.0"):
        peers.require([peers.Peer("zlab", 16)])


def test_a_peer_block_larger_than_the_drafter_is_refused(pair):
    _zlab()
    target_dir, draft_dir, _ = pair
    with pytest.raises(ValueError, match="zlab:8: larger than the drafter's block size 4"):
        peers.Models(target_dir, draft_dir, [peers.Peer("zlab", 8)])
