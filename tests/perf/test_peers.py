"""Peers on the same weights: transformers' generate (``hf:ar``) and z-lab's dflash package (``zlab:B``) on a tiny
checkpoint transformers wrote, their texts compared with plain decoding's, and the bench's table reporting them."""

from __future__ import annotations

import dataclasses
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


@pytest.fixture(scope="module")
def dflash2_dirs(pair, tmp_path_factory):
    """{conv kernel: z-lab-format DFlash2 drafter dir}: the tiny drafter with DFlash2's convolutions (groups of 8)
    and a selector (rank 8, top-5), conv kernel 2 (the released checkpoints') or 4."""
    target = pair[2]
    dirs = {}
    for kernel in (2, 4):
        cfg = dataclasses.replace(tiny_drafter_config(target.cfg), conv_kernel_size=kernel, conv_group_size=8,
                                  selector_rank=8, selector_top_k=5)
        dirs[kernel] = tmp_path_factory.mktemp(f"peers_dflash2_{kernel}") / "drafter"
        save_drafter(dirs[kernel], init_drafter(cfg, dtype=jnp.float32))
    return dirs


def test_zlab_peer_runs_a_dflash2_drafter_through_its_selector(pair, dflash2_dirs):
    """A DFlash2 checkpoint is z-lab's DFlash2DraftModel in the peer, and z-lab's own dflash_generate walks its
    selector (``propose``) at every drafted block; on the hybrid target the rollback is exact (as for DFlash)."""
    _zlab()
    from dflash import model as zlab

    target_dir = pair[0]
    peer = peers.Peer("zlab", 4)
    models = peers.Models(target_dir, dflash2_dirs[2], [peer])
    assert type(models.drafter) is zlab.DFlash2DraftModel and models.dflash2
    assert any(t == "linear_attention" for t in models.target.config.layer_types)
    calls = []
    propose = models.drafter.propose
    models.drafter.propose = lambda *a, **k: calls.append(a[0].shape[1]) or propose(*a, **k)
    out, _, _ = peers.runner(peer, models, [PROMPTS[:1]], max_new_tokens=5, stop_ids=(),
                             sampling=SamplingConfig())(0, _clock())
    assert len(calls) == out.steps[0] and calls[0] == 3  # every step drafts (the last ones shorter blocks)
    with models.torch.inference_mode():  # plain greedy decoding (transformers', the oracle of ours)
        plain = models.target.generate(models.torch.tensor(PROMPTS[:1]), max_new_tokens=5, do_sample=False)
    assert out.token_lists() == [plain[0, len(PROMPTS[0]):].tolist()]


def test_zlab_dflash2_short_block_failure_is_reported_in_one_line(pair, dflash2_dirs):
    """z-lab 0.1.0's convolution fails on a block shorter than kernel - 1, which its loop verifies in its last
    steps: the peer says so by name (the limit is z-lab's; ours is exact at every length, test_dflash2)."""
    _zlab()
    target_dir, _, _ = pair
    peer = peers.Peer("zlab", 4)
    models = peers.Models(target_dir, dflash2_dirs[4], [peer])
    run = peers.runner(peer, models, [PROMPTS[:1]], max_new_tokens=5, stop_ids=(), sampling=SamplingConfig())
    with pytest.raises(ValueError, match=r"zlab:4: z-lab's dflash 0.1.0 cannot run this DFlash2 drafter to the end: "
                                         r"its _grouped_dynamic_convolve fails on a block of 2 tokens, shorter than "
                                         r"conv_kernel_size 4 - 1"):
        run(0, _clock())
