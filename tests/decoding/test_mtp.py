"""Qwen3.5's MTP head: ``mtp_step`` against numpy, lossless as a proposer, its context invariant, loading.

The targets are the tiny transformers checkpoints of conftest.py with a random ``mtp.*`` head added
(per-expert tensors for MoE), so loading is tested on the way and no model is initialised in JAX.
Shapes are shared across tests (batch 4, bucket 16, 24 new tokens) to keep compiles few.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from dflash_jax import kernels
from dflash_jax.config import TargetConfig
from dflash_jax.decoding.api import make_generate, pad_prompts
from dflash_jax.decoding.loop import FinishReason, SpecConfig, SpeculativeLoop
from dflash_jax.decoding.mtp import MTPProposer, mtp_params, mtp_step
from dflash_jax.decoding.proposers import NoProposer, TargetView
from dflash_jax.decoding.sampling import SamplingConfig, probs
from dflash_jax.io.checkpoint import write_safetensors
from dflash_jax.models.cache import position_table
from dflash_jax.models.target import Qwen35ForCausalLM, Target, forward, load_target

PROMPT_LENS, BUCKET, MAX_NEW = (5, 12, 1, 9), 16, 24


def _with_mtp_head(src, dst, per_expert: bool) -> dict[str, np.ndarray]:
    """Copies an HF checkpoint and adds random ``mtp.*`` tensors (MoE experts one tensor per expert, as
    in the official checkpoints); returns them in the loader's canonical (fused) layout."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (dst / "config.json").write_text(json.dumps(config))
    cfg = TargetConfig.from_pretrained(dst)
    abstract = nnx.state(nnx.eval_shape(lambda: Qwen35ForCausalLM(cfg, mtp=True, rngs=nnx.Rngs(0))).mtp)
    rng = np.random.default_rng(0)
    tensors, written = load_file(str(dst / "model.safetensors")), {}
    for path, v in nnx.to_flat_state(abstract):
        key = "mtp." + ".".join(map(str, path))
        shape = v.get_value().shape
        # Norm weights are offsets from 1 (zero-centred): perturb them, as conftest does for the body.
        written[key] = a = ((0.1 if "norm" in key else 0.02) * rng.standard_normal(shape)).astype(np.float32)
        group = key.rsplit(".", 1)[0]
        if per_expert and key.endswith(".experts.gate_up_proj"):  # [E, 2I, D]: gate rows, then up rows
            for e, (gate, up) in enumerate(zip(*np.split(a, 2, axis=1), strict=True)):
                tensors[f"{group}.{e}.gate_proj.weight"], tensors[f"{group}.{e}.up_proj.weight"] = gate, up
        elif per_expert and key.endswith(".experts.down_proj"):  # [E, D, I]
            for e in range(a.shape[0]):
                tensors[f"{group}.{e}.down_proj.weight"] = a[e]
        else:
            tensors[key] = a
    write_safetensors(dst / "model.safetensors", tensors)
    return written


@pytest.fixture(scope="module")
def checkpoints(hf_dense, hf_moe, tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    return {kind: (root / kind, _with_mtp_head(src, root / kind, per_expert=kind == "moe"))
            for kind, (_, src) in (("dense", hf_dense), ("moe", hf_moe))}


def _predictable(tg: Target) -> Target:
    """The target with an LM head that only scores token 0 (so it emits 0 or 1): random MTP drafts are then
    often right and accepted drafts occur, as with a trained head."""
    flat = [(p, v.replace(jnp.asarray(np.where(np.arange(v.get_value().shape[0])[:, None] < 1, 30 * v.get_value(), 0))))
            if p == ("lm_head", "weight") else (p, v) for p, v in nnx.to_flat_state(tg.params)]
    return dataclasses.replace(tg, params=nnx.from_flat_state(flat))


@pytest.fixture(scope="module")
def targets(checkpoints):
    return {kind: _predictable(load_target(path, dtype=jnp.float32, progress=False))
            for kind, (path, _) in checkpoints.items()}


@pytest.fixture(scope="module")
def dense(targets):
    return targets["dense"]


def _prompts(vocab, seed=0):
    rng = np.random.default_rng(seed)
    return pad_prompts([rng.integers(0, vocab, n).tolist() for n in PROMPT_LENS], BUCKET)


@functools.partial(jax.jit, static_argnames="graphdef")
def _mtp_step(graphdef, params, tokens, hidden, k_cache, v_cache, start):
    model = nnx.merge(graphdef, params)
    return mtp_step(model.mtp, TargetView.of(params), tokens, hidden, k_cache, v_cache, start,
                    position_table(model.cfg, k_cache.shape[2]))


def _zeros_cache(cfg, B, S):
    return list(kernels.empty_cache(B, S, cfg.num_key_value_heads, cfg.head_dim, jnp.float32))


# ---- numpy reference of the MTP formulas (Qwen3.5 norms, gated attention, partial NeoX RoPE, SwiGLU) ----

def _norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * (1 + w)


def _rope(x, cfg):
    """x [T, N, H] at positions 0..T-1, rotating the first rotary_dim channels in halves."""
    r, T = cfg.rotary_dim, x.shape[0]
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, r, 2) / r)
    ang = np.arange(T)[:, None] * inv  # [T, r/2]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2 = x[..., :r // 2], x[..., r // 2:r]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., r:]], -1)


def _np_mlp(w, cfg, y, prefix):
    """SwiGLU, or the MoE block: softmax router, top-k renormalised, plus the sigmoid-gated shared expert."""
    def swiglu(y, gate, up, down):
        g = y @ gate.T
        return (g / (1 + np.exp(-g)) * (y @ up.T)) @ down.T

    if not cfg.is_moe:
        return swiglu(y, *(w[prefix + f"{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj")))
    logits = y @ w[prefix + "gate.weight"].T
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.zeros_like(y)
    gate_up, down, I = w[prefix + "experts.gate_up_proj"], w[prefix + "experts.down_proj"], cfg.moe_intermediate_size
    for t in range(len(y)):
        top = np.argsort(-p[t])[:cfg.num_experts_per_tok]
        for e in top:
            out[t] += p[t, e] / p[t, top].sum() * swiglu(y[t], gate_up[e, :I], gate_up[e, I:], down[e])
    shared = swiglu(y, *(w[prefix + f"shared_expert.{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj")))
    return out + shared / (1 + np.exp(-(y @ w[prefix + "shared_expert_gate.weight"].T)))


def _np_mtp(w, cfg, tokens, hidden):
    """One row: entries at positions 0..T-1 with tokens [T] and hidden [T, D] -> post-norm output [T, D]."""
    eps, N, K, H = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    T, L = len(tokens), "mtp.layers.0."
    e = _norm(w["model.embed_tokens.weight"][tokens], w["mtp.pre_fc_norm_embedding.weight"], eps)
    h = _norm(hidden, w["mtp.pre_fc_norm_hidden.weight"], eps)
    x = np.concatenate([e, h], -1) @ w["mtp.fc.weight"].T
    y = _norm(x, w[L + "input_layernorm.weight"], eps)
    qg = (y @ w[L + "self_attn.q_proj.weight"].T).reshape(T, N, 2 * H)
    q = _rope(_norm(qg[..., :H], w[L + "self_attn.q_norm.weight"], eps), cfg)
    k = _rope(_norm((y @ w[L + "self_attn.k_proj.weight"].T).reshape(T, K, H), w[L + "self_attn.k_norm.weight"],
                    eps), cfg)
    v = (y @ w[L + "self_attn.v_proj.weight"].T).reshape(T, K, H)
    k, v = np.repeat(k, N // K, axis=1), np.repeat(v, N // K, axis=1)
    s = np.einsum("tnh,snh->nts", q, k) / np.sqrt(H) + np.where(np.tri(T) > 0, 0.0, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    o = np.einsum("nts,snh->tnh", p / p.sum(-1, keepdims=True), v).reshape(T, N * H)
    o = o / (1 + np.exp(-qg[..., H:].reshape(T, N * H)))
    x = x + o @ w[L + "self_attn.o_proj.weight"].T
    x = x + _np_mlp(w, cfg, _norm(x, w[L + "post_attention_layernorm.weight"], eps), L + "mlp.")
    return _norm(x, w["mtp.norm.weight"], eps)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_mtp_step_matches_numpy_incrementally(targets, kind):
    """Entries 0..3 in one call, then four more per row from a per-row start, against one numpy pass."""
    tg = targets[kind]
    cfg = tg.cfg
    w = {".".join(map(str, p)): np.asarray(v.get_value(), np.float64) for p, v in nnx.to_flat_state(tg.params)}
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (2, 8)).astype(np.int32)
    hidden = rng.standard_normal((2, 8, cfg.hidden_size)).astype(np.float32)
    kc, vc = _zeros_cache(cfg, 2, 16)
    out1, kc, vc = _mtp_step(tg.graphdef, tg.params, tokens[:, :4], hidden[:, :4], kc, vc, jnp.zeros(2, jnp.int32))
    start = np.array([4, 3], np.int32)  # row 1 rewrites entry 3: a dead row overwritten, as after a rejection
    rows = np.stack([np.arange(s, s + 4) for s in start])
    out2, _, _ = _mtp_step(tg.graphdef, tg.params, np.take_along_axis(tokens, rows, 1),
                           np.take_along_axis(hidden, rows[..., None], 1), kc, vc, jnp.asarray(start))
    for b in range(2):
        ref = _np_mtp(w, cfg, tokens[b], hidden[b].astype(np.float64))
        np.testing.assert_allclose(out1[b], ref[:4], atol=1e-5)
        np.testing.assert_allclose(out2[b], ref[rows[b]], atol=1e-5)


@pytest.fixture(scope="module")
def prompts(dense):
    return _prompts(dense.cfg.vocab_size)


@pytest.fixture(scope="module")
def plain(dense, prompts):
    return _run(dense, NoProposer(), (), 1, *prompts)


@pytest.fixture(scope="module")
def block4(dense, prompts):
    """Block 4 (three MTP drafts) through the loop's own jitted init and step, keeping the states."""
    tokens, lengths = prompts
    spec = SpecConfig(block_size=4, max_new_tokens=MAX_NEW, stop_ids=())
    loop = SpeculativeLoop.of(dense, MTPProposer(dense.cfg, 3), spec)
    params = (dense.params, mtp_params(dense))
    state = loop.init(params, tokens, lengths, 0)
    first = jax.tree.map(jnp.copy, state)  # the step donates its input state
    while (np.asarray(state.finish) == FinishReason.RUNNING).any():
        state = loop.step(params, state)
    return loop, first, state


def _run(target, proposer, pparams, block, tokens, lengths):
    spec = SpecConfig(block_size=block, max_new_tokens=MAX_NEW, stop_ids=())
    return make_generate(target, proposer, spec)((target.params, pparams), tokens, lengths, 0)


def test_greedy_block2_lossless(dense, prompts, plain):
    out = _run(dense, MTPProposer(dense.cfg, 1), mtp_params(dense), 2, *prompts)
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    assert (np.asarray(out.accepted).sum(0) > 0).all(), np.asarray(out.accepted).sum(0)  # both 0 and 1


def test_greedy_block4_lossless_and_context_is_teacher_forced(dense, prompts, plain, block4):
    """Lossless, and at the end the head's cache rows 0..length-1 equal one mtp_step over the committed
    sequence with the target's hidden states from ``forward``: entry t holds (x_{t+1}, h_t)."""
    (tokens, lengths), (loop, _, state) = prompts, block4
    final = loop.output(state)
    np.testing.assert_array_equal(final.tokens, plain.tokens)
    hist = np.asarray(final.accepted).sum(0)
    assert hist[0] > 0 and hist[1:].sum() > 0, hist
    st, n_out = state.proposer, np.asarray(state.n_out)
    np.testing.assert_array_equal(st.length + st.count, state.cache.lengths)
    seqs = [list(tokens[b, :lengths[b]]) + list(np.asarray(state.out)[b, :n_out[b]]) for b in range(len(lengths))]
    T = max(map(len, seqs))
    seq = np.array([s + [0] * (T - len(s)) for s in seqs], np.int32)
    hidden = jax.jit(forward, static_argnames="graphdef")(dense.graphdef, dense.params, seq).hidden
    kc, vc = _zeros_cache(dense.cfg, len(seqs), T - 1)
    _, k, v = _mtp_step(dense.graphdef, dense.params, seq[:, 1:], hidden[:, :-1], kc, vc,
                        jnp.zeros(len(seqs), jnp.int32))
    for b, s in enumerate(seqs):
        # Drafts accepted past max_new_tokens are committed but not emitted: their entries are not checked.
        n = min(int(st.length[b]), len(s) - 1)
        assert n > lengths[b] + MAX_NEW // 2
        np.testing.assert_allclose(st.k[b, :, :n], k[b, :, :n], atol=2e-5, err_msg=f"row {b}")  # [K, S, H]
        np.testing.assert_allclose(st.v[b, ..., :n], v[b, ..., :n], atol=2e-5, err_msg=f"row {b}")  # [K, H, S]


def test_sampled_drafts_follow_the_unrolled_chain(dense, block4):
    """After prefill, d_1 comes from the entry (anchor, h_{P-1}) at P-1 and d_j from (d_{j-1}, the head's
    previous output) one position further; q is each step's sampling distribution."""
    loop, first, _ = block4
    st, sampling = first.proposer, SamplingConfig(temperature=1.0, draft_mode="sampled")
    propose = jax.jit(lambda params, st, anchor, keys: loop.proposer.propose(
        params=params["mtp"], view=TargetView.of(params), state=st, anchor=anchor, k=3, keys=keys,
        sampling=sampling)[:2])
    drafts, q = propose(dense.params, st, first.anchor, jax.random.split(jax.random.key(3), 4))
    model, rows = dense.module(), np.arange(4)
    h, kc, vc = _mtp_step(dense.graphdef, dense.params, first.anchor[:, None], st.hidden[:, :1], st.k, st.v,
                          st.length)
    for j in range(3):
        ref = probs(model.logits(h[:, 0]), sampling)
        np.testing.assert_allclose(q[:, j], ref, atol=1e-5, err_msg=f"draft {j + 1}")
        assert (ref[rows, drafts[:, j]] > 0).all()
        h, kc, vc = _mtp_step(dense.graphdef, dense.params, drafts[:, j:j + 1], h, kc, vc, st.length + 1 + j)


def test_bad_configurations_are_clear_errors(dense, checkpoints):
    with pytest.raises(ValueError, match="num_steps must be in 1..15"):
        MTPProposer(dense.cfg, 16)
    with pytest.raises(ValueError, match="one MTP layer"):
        MTPProposer(dataclasses.replace(dense.cfg, mtp_num_hidden_layers=0), 3)
    no_head = load_target(checkpoints["dense"][0], dtype=jnp.float32, mtp=False, progress=False)
    with pytest.raises(ValueError, match="no MTP head"):
        mtp_params(no_head)
    for wrong in ((), dense.params):  # the old conventions: no params, or the whole target's
        with pytest.raises(ValueError, match="MTPProposer's params are the target's MTP head"):
            MTPProposer(dense.cfg, 3).init(params=wrong, view=TargetView.of(dense.params), prefill=None,
                                           prompts=jnp.ones((1, 1)), prompt_lens=jnp.ones(1, jnp.int32), capacity=8)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_checkpoint_with_mtp_head_loads(checkpoints, kind):
    path, written = checkpoints[kind]
    tg = load_target(path, dtype=jnp.float32, progress=False)
    assert tg.cfg.mtp_num_hidden_layers == 1
    loaded = {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(tg.params)}
    assert {k for k in loaded if k.startswith("mtp.")} == set(written)
    for key, a in written.items():
        np.testing.assert_array_equal(loaded[key], a, err_msg=key)
    without = load_target(path, dtype=jnp.float32, mtp=False, progress=False)
    assert without.module().mtp is None and "mtp" not in without.params


def test_proposer_of_a_target_follows_its_kernel_mode():
    """MTPProposer.of takes the head's graph from the target: a target built with (or switched to) a
    kernel mode drafts in that mode, where a head rebuilt from the bare cfg runs the default one."""
    from dflash_jax.models.target import init_target

    cfg = TargetConfig(vocab_size=16, hidden_size=16, num_hidden_layers=2,
                       layer_types=("linear_attention", "full_attention"), num_attention_heads=2,
                       num_key_value_heads=1, head_dim=8, linear_num_key_heads=1, linear_num_value_heads=2,
                       linear_key_head_dim=8, linear_value_head_dim=8, intermediate_size=24, mtp_num_hidden_layers=1)
    target = init_target(cfg, mtp=True, kernels="interpret")

    def modes(proposer):
        head = proposer.head(mtp_params(target))
        return {m.kernels for _, m in nnx.iter_modules(head) if hasattr(m, "kernels")}

    of = MTPProposer.of(target, 3)
    assert modes(of) == {"interpret"} and of.kernels == "interpret"
    assert modes(MTPProposer(cfg, 3, kernels="reference")) == {"reference"}
    switched = MTPProposer.of(target.with_kernels("reference"), 3)
    assert modes(switched) == {"reference"}
    assert switched != of and hash(switched) != hash(of)
    assert MTPProposer.of(target, 3) == of  # equal heads: equal proposers (one jit cache entry)
    with pytest.raises(ValueError, match="no MTP head"):
        MTPProposer.of(init_target(cfg), 3)
