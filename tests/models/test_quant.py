"""MXFP4 target weights: the format against a reference written from the OCP MX spec, Quark-layout
checkpoints with known bytes, quantized targets against bf16, lossless speculative decoding with a
quantized target (DFlash and MTP, dense and MoE), converted copies, and config errors."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.config import DEFAULT_EXCLUDE, ConfigError, DrafterConfig, QuantConfig, TargetConfig
from dflash_jax.decoding.api import generate
from dflash_jax.decoding.mtp import MTPProposer, mtp_params
from dflash_jax.io import checkpoint
from dflash_jax.kernels import mxfp4
from dflash_jax.models import quant, quark
from dflash_jax.models.drafter import init_drafter
from dflash_jax.models.layers import Experts, Linear, MXFP4Weight, with_kernels
from dflash_jax.models.target import Qwen35ForCausalLM, init_target, load_target, save_converted

# e2m1 magnitudes by code 0..7 (OCP MX spec: bit 3 sign, bits 2-1 exponent with bias 1, bit 0 mantissa).
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


# ---------------------------------------------------------------------------------------------
# An independent reference quantizer, element by element from the spec (Python floats, exact)


def _ref_block(block):
    """32 floats -> (scale byte, 32 codes): X = 2^(floor(log2 amax) - emax), emax = 2, clamped to
    e8m0's [-127, 127]; each v / X rounded to the nearest e2m1 value, ties to the even code, |v| > 6 -> 6."""
    amax = max(abs(float(v)) for v in block)
    if amax == 0:
        shared = -127
    else:
        m, e = math.frexp(amax)  # amax = m * 2^e, m in [0.5, 1)
        shared = min(max(e - 1 - 2, -127), 127)
    codes = []
    for v in block:
        s = math.ldexp(abs(float(v)), -shared)
        best = min(range(8), key=lambda c: (abs(E2M1[c] - s), c % 2))  # nearest; a tie takes the even code
        codes.append(best | (8 if math.copysign(1.0, float(v)) < 0 else 0))
    return shared + 127, codes


def _ref_quantize(w):
    w = np.asarray(w, np.float32)
    scales = np.zeros((w.shape[0], w.shape[1] // 32), np.uint8)
    codes = np.zeros(w.shape, np.uint8)
    for n in range(w.shape[0]):
        for b in range(w.shape[1] // 32):
            scales[n, b], codes[n, 32 * b:32 * b + 32] = _ref_block(w[n, 32 * b:32 * b + 32])
    return codes, scales


def _ref_values(codes, scales):
    mag = np.array(E2M1)[codes & 7] * np.where(codes & 8, -1.0, 1.0)
    return mag * np.repeat(2.0 ** (scales.astype(np.float64) - 127), 32, axis=-1)


def _spec_cases():
    rng = np.random.default_rng(0)
    grid = np.array(E2M1 + [-v for v in E2M1], np.float32)
    rows = [
        np.concatenate([grid, grid]),                                   # every code point, scale 1
        np.concatenate([grid, grid]) * 2.0**-20,                        # ... at a small scale
        np.concatenate([grid, grid]) * 2.0**90,                         # ... and a large one
        np.where(np.arange(32) % 2, 0.5, -0.5).astype(np.float32),      # +-0.5 only: amax 0.5 -> X = 2^-3
        np.zeros(32, np.float32),                                       # all-zero block
        np.full(32, 6.0, np.float32),                                   # the maximum
        np.array([7.9, 6.5, -7.0, 3.5, 5.0, 0.25, 0.75, 1.25] + [0.0] * 24, np.float32),  # saturation, ties
        (rng.standard_normal(32) * np.exp(rng.uniform(-6, 6, 32))).astype(np.float32),  # mixed magnitudes
    ]
    # Midpoints of the grid and their neighbours one ulp away (round-to-nearest-even vs double rounding).
    mids = np.array([(a + b) / 2 for a, b in zip(E2M1, E2M1[1:], strict=False)], np.float32)
    near = np.concatenate([mids, np.nextafter(mids, 0), np.nextafter(mids, 7), [6.0]]).astype(np.float32)
    rows.append(np.concatenate([near, -near[:32 - len(near)]]) if len(near) < 32 else near[:32])
    w = np.stack(rows)
    # Exact powers of two at block boundaries: elements 31 | 32 straddle two blocks of different scale.
    edges = np.zeros((3, 64), np.float32)
    edges[0, 31], edges[0, 32] = 2.0**3, 2.0**-4
    edges[1, 31], edges[1, 32] = -(2.0**-126), 2.0**126          # smallest normal | near the f32 top
    edges[2, 0], edges[2, 63] = 4.0, -1.0                        # amax exactly 4 -> X = 1; amax 1 -> X = 2^-2
    return w, edges


@pytest.mark.parametrize("which", [0, 1])
def test_quantizer_matches_spec_reference(which):
    w = _spec_cases()[which]
    packed, scales = mxfp4.quantize_mxfp4(jnp.asarray(w))
    codes, want_scales = _ref_quantize(w)
    np.testing.assert_array_equal(np.asarray(scales), want_scales)
    np.testing.assert_array_equal(np.asarray(mxfp4.unpack_e2m1(packed)), codes)
    # XLA flushes f32 subnormals, so the one subnormal scale, 2^-127 (byte 0), reads as 0.
    want = np.where(np.repeat(want_scales, 32, axis=-1) == 0, 0.0, _ref_values(codes, want_scales))
    np.testing.assert_array_equal(np.asarray(mxfp4.dequantize_mxfp4(packed, scales)), want.astype(np.float32))


def test_quantizer_spot_values():
    """A few results written out by hand from the spec."""
    w = np.zeros((1, 64), np.float32)
    w[0, :4] = [7.9, 0.25, -0.3, 2.5]      # amax 7.9: X = 2^0 -> 6, 0 (tie, even), -0.5, 2 (tie, even)
    w[0, 32:34] = [0.5, -0.5]              # amax 0.5: X = 2^-3 -> 4.0 and -4.0: codes 6 and 14
    packed, scales = mxfp4.quantize_mxfp4(jnp.asarray(w))
    assert np.asarray(scales).tolist() == [[127, 124]]
    codes = np.asarray(mxfp4.unpack_e2m1(packed))[0]
    assert codes[:4].tolist() == [7, 0, 9, 4] and codes[32:34].tolist() == [6, 14]
    assert np.asarray(packed)[0, :2].tolist() == [0x07, 0x49] and np.asarray(packed)[0, 16] == 0xE6  # even: low


def test_pack_unpack_round_trip():
    codes = np.random.default_rng(1).integers(0, 16, (3, 5, 64), dtype=np.uint8)
    packed = mxfp4.pack_e2m1(jnp.asarray(codes))
    assert packed.shape == (3, 5, 32) and packed.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(packed), codes[..., 0::2] | (codes[..., 1::2] << 4))
    np.testing.assert_array_equal(np.asarray(mxfp4.unpack_e2m1(packed)), codes)


# ---------------------------------------------------------------------------------------------
# Tiny models whose every projection width is a multiple of 32

_COMMON = dict(vocab_size=128, hidden_size=32, num_hidden_layers=4,
               layer_types=("linear_attention", "linear_attention", "linear_attention", "full_attention"),
               num_attention_heads=2, num_key_value_heads=1, head_dim=16, rope_theta=10000.0,
               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
               mtp_num_hidden_layers=1)
CONFIGS = {
    "dense": TargetConfig(**_COMMON, intermediate_size=64),
    "moe": TargetConfig(**_COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=32),
}


@pytest.fixture(scope="module", params=["dense", pytest.param("moe", marks=pytest.mark.slow)])
def pair(request):
    """(kind, f32 target, the same target with MXFP4 projections). The MoE model tests are slow (compiles);
    the MoE checkpoint layout is covered fast by the Quark-layout tests below."""
    target = init_target(CONFIGS[request.param], dtype=jnp.float32, mtp=True, seed=3)
    return request.param, target, quant.convert(target, True)


def test_default_plan_quantizes_projections_and_keeps_heads_dense(pair):
    kind, target, q = pair
    lay = quant.layout(q.module())
    assert lay["input_scale_mode"] is None
    names = set(lay["quantized"])
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in names
    assert "model.layers.3.self_attn.q_proj.weight" in names
    assert not any(n.startswith("mtp.") for n in names)
    if kind == "moe":
        assert {"model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"} <= names
        assert "model.layers.1.mlp.shared_expert.down_proj.weight" in names
        assert "model.layers.1.mlp.gate.weight" not in names and not any("shared_expert_gate" in n for n in names)
    else:
        assert "model.layers.2.mlp.down_proj.weight" in names
    flat = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(q.params)}
    w = flat["model.layers.3.self_attn.q_proj.weight"]
    assert isinstance(w, MXFP4Weight) and w.shape == (64, 32)
    assert (w.codes.dtype, w.codes.shape, w.scale.dtype, w.scale.shape) == (jnp.uint8, (64, 16), jnp.uint8, (64, 1))


def _bytes(target, names):
    flat = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(target.params)}
    return sum(flat[n].codes.nbytes + flat[n].scale.nbytes for n in names)


def test_quantized_logits_close_to_dense(pair):
    kind, target, q = pair
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 12)), jnp.int32)
    lengths = jnp.array([12, 7], jnp.int32)
    dense, _ = target.prefill(tokens, lengths, capacity=16)
    mx, _ = q.prefill(tokens, lengths, capacity=16)
    err = float(jnp.linalg.norm(mx.logits - dense.logits) / jnp.linalg.norm(dense.logits))
    print(f"\n{kind}: relative logit error MXFP4 vs f32 {err:.4f}")
    assert 0 < err < 0.25
    # Back to dense: exactly the dequantized weights, so the same logits as the MXFP4 path computes.
    back = quant.convert(q, False)
    assert quant.layout(back.module()) is None
    again, _ = back.prefill(tokens, lengths, capacity=16)
    np.testing.assert_allclose(np.asarray(again.logits), np.asarray(mx.logits), rtol=1e-5, atol=1e-5)
    lay = quant.layout(q.module())["quantized"]
    ratio = _bytes(q, lay) / (sum(math.prod(target_shape) for target_shape in _dense_shapes(target, lay)) * 2)
    assert abs(ratio - (0.5 + 1 / 32) / 2) < 1e-9  # 0.2656x the bf16 bytes of the same tensors


def _dense_shapes(target, names):
    flat = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(target.params)}
    return [flat[n].shape for n in names]


def _drafter(cfg):
    dcfg = DrafterConfig(hidden_size=cfg.hidden_size, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, intermediate_size=64, rms_norm_eps=1e-6,
                         rope_theta=10000.0, vocab_size=cfg.vocab_size, block_size=8,
                         mask_token_id=cfg.vocab_size - 1, target_layer_ids=(0, 2),
                         num_target_layers=cfg.num_hidden_layers, layer_types=("full_attention",),
                         sliding_window=None, is_causal=None, target_hidden_size=cfg.hidden_size)
    return init_drafter(dcfg, dtype=jnp.float32, seed=1)


_PROMPTS = [np.random.default_rng(5).integers(0, 128, n).tolist() for n in (6, 11)]
_GEN = dict(max_new_tokens=20, stop_ids=())


@pytest.fixture(scope="module")
def plain(pair):
    """The quantized target's own greedy decoding of ``_PROMPTS``."""
    out = generate(pair[2], _PROMPTS, block_size=1, **_GEN).token_lists()
    assert all(len(t) == 20 for t in out)
    return out


def test_dflash_with_quantized_target_is_lossless(pair, plain):
    """Greedy DFlash (block 8) with an MXFP4 target equals that target's plain decoding, token for token."""
    q = pair[2]
    assert generate(q, _PROMPTS, drafter=_drafter(q.cfg), block_size=8, **_GEN).token_lists() == plain


@pytest.mark.slow
def test_mtp_with_quantized_target_is_lossless(pair, plain):
    """Greedy MTP (3 steps; the mtp.* head stays bf16) with an MXFP4 target equals its plain decoding."""
    q = pair[2]
    assert generate(q, _PROMPTS, drafter=(MTPProposer(q.cfg, 3), mtp_params(q)), block_size=4,
                    **_GEN).token_lists() == plain


@pytest.mark.slow
def test_activation_qdq_changes_the_product(pair):
    kind, target, q = pair
    qa = quant.convert(target, True, QuantConfig(input_scale_mode="even"))
    assert quant.layout(qa.module())["input_scale_mode"] == "even"
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 128, (1, 8)), jnp.int32)
    a, _ = q.prefill(tokens, jnp.array([8]), capacity=8)
    b, _ = qa.prefill(tokens, jnp.array([8]), capacity=8)
    assert not np.allclose(np.asarray(a.logits), np.asarray(b.logits))
    assert float(jnp.linalg.norm(a.logits - b.logits) / jnp.linalg.norm(a.logits)) < 0.25


# ---------------------------------------------------------------------------------------------
# Quark-layout checkpoints


def _write_dense(target, path):
    """The target as an HF checkpoint in transformers' per-expert layout (with the writer's helper
    on a dense model, which only splits the experts)."""
    path.mkdir(parents=True, exist_ok=True)
    checkpoint.write_safetensors(path / "model.safetensors", quark._tensors(target, np.float32))
    raw = {"architectures": ["Qwen3_5MoeForCausalLM" if target.cfg.is_moe else "Qwen3_5ForCausalLM"],
           "layer_types": list(target.cfg.layer_types), **{k: v for k, v in _COMMON.items() if k != "layer_types"},
           "partial_rotary_factor": 0.25, "tie_word_embeddings": False}
    if target.cfg.is_moe:
        raw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    else:
        raw.update(intermediate_size=64)
    (path / "config.json").write_text(json.dumps(raw))
    (path / "tokenizer_config.json").write_text("{}")
    return raw


def test_hand_written_quark_checkpoint_dequantizes_to_known_values(tmp_path):
    """Bytes chosen by hand: 0x71 holds element 0 = code 1 (0.5) and element 1 = code 7 (6.0); scale
    byte 130 is 2^3. The wrong nibble order would give (48, 4), a wrong bias 2^2 or 2^4."""
    target = init_target(CONFIGS["moe"], dtype=jnp.float32, seed=0)
    raw = _write_dense(target, tmp_path / "src")
    tensors = quark._tensors(target, np.float32)
    known = {"model.layers.0.mlp.shared_expert.down_proj": (32, 32),     # a Linear [out, in]
             "model.layers.0.mlp.experts.2.up_proj": (32, 32)}           # one expert's slice
    for name, (n_out, n_in) in known.items():
        tensors[name + ".weight"] = np.full((n_out, n_in // 2), 0x71, np.uint8)
        tensors[name + ".weight_scale"] = np.full((n_out, n_in // 32), 130, np.uint8)
    # Every other expert and the rest of the experts tensor: quantized from its values.
    for key in [k for k in tensors if ".experts." in k and k.endswith(".weight")]:
        if key.removesuffix(".weight") not in known:
            p, s = mxfp4.quantize_mxfp4(jnp.asarray(tensors[key]))
            tensors[key], tensors[key + "_scale"] = np.asarray(p), np.asarray(s)
    path = tmp_path / "quark"
    path.mkdir()
    checkpoint.write_safetensors(path / "model.safetensors", tensors)
    exclude = ["lm_head", "mtp.*", "*mlp.gate", "*shared_expert_gate*", "*.linear_attn.*", "*.self_attn.*",
               "re:.*shared_expert\\.(gate|up)_proj", *[f"model.language_model.layers.{i}.mlp.shared_expert.down_proj"
                                                          for i in (1, 2, 3)]]
    qcfg = QuantConfig(exclude=tuple(exclude))
    (path / "config.json").write_text(json.dumps({**raw, "quantization_config": qcfg.to_hf()}))

    loaded = load_target(path, dtype=jnp.float32, progress=False)
    lay = quant.layout(loaded.module())["quantized"]
    assert sorted(lay) == sorted(["model.layers.0.mlp.shared_expert.down_proj.weight",
                                  *[f"model.layers.{i}.mlp.experts.{p}" for i in range(4)
                                    for p in ("gate_up_proj", "down_proj")]])
    dense = quant.convert(loaded, False)
    flat = {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(dense.params)}
    want = np.tile([4.0, 48.0], 16)
    assert (flat["model.layers.0.mlp.shared_expert.down_proj.weight"] == want).all()
    np.testing.assert_array_equal(flat["model.layers.0.mlp.experts.gate_up_proj"][2, 32:], np.tile(want, (32, 1)))
    # The other way: quantizing those values writes the same bytes.
    p, s = mxfp4.quantize_mxfp4(jnp.asarray(np.tile(want, (2, 1)), jnp.float32))
    assert (np.asarray(p) == 0x71).all() and (np.asarray(s) == 130).all()
    # Excluded projections loaded as stored.
    np.testing.assert_array_equal(flat["model.layers.1.mlp.shared_expert.down_proj.weight"],
                                  tensors["model.layers.1.mlp.shared_expert.down_proj.weight"])


def test_save_quark_round_trip_and_orbax_copy(tmp_path):
    target = init_target(CONFIGS["moe"], dtype=jnp.float32, mtp=True, seed=4)
    _write_dense(target, tmp_path / "src")
    src = load_target(tmp_path / "src", dtype=jnp.float32, progress=False)
    qcfg = QuantConfig(exclude=(*DEFAULT_EXCLUDE, "*.self_attn.*"))
    q = quant.convert(src, True, qcfg)
    quark.save_quark(q, qcfg, tmp_path / "src", tmp_path / "out", dtype=jnp.float32, shard_bytes=20_000)
    out = tmp_path / "out"
    assert (out / "model.safetensors.index.json").is_file() and (out / "tokenizer_config.json").is_file()
    raw = json.loads((out / "config.json").read_text())
    assert raw["quantization_config"]["quant_method"] == "quark"
    assert QuantConfig.from_hf(raw) == qcfg
    files = checkpoint.checkpoint_files(out)
    assert "model.layers.0.mlp.experts.3.gate_proj.weight_scale" in files
    header = checkpoint.read_safetensors_header(files["model.layers.0.mlp.experts.3.gate_proj.weight"])[0]
    assert header["model.layers.0.mlp.experts.3.gate_proj.weight"] == {
        **header["model.layers.0.mlp.experts.3.gate_proj.weight"], "dtype": "U8", "shape": [32, 16]}

    back = load_target(out, dtype=jnp.float32, progress=False)
    for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(q.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert quant.layout(back.module()) == quant.layout(q.module())
    # Load-time choice: the same checkpoint dense.
    dense = load_target(out, dtype=jnp.float32, progress=False, quantized=False)
    assert quant.layout(dense.module()) is None

    save_converted(back, out, tmp_path / "conv")
    conv = load_target(tmp_path / "conv", progress=False)
    assert quant.layout(conv.module()) == quant.layout(q.module())
    for a, b in zip(jax.tree.leaves(conv.params), jax.tree.leaves(q.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_quantized_projection_is_one_parameter_holding_an_mxfp4_weight(tmp_path):
    """Loaded from Quark's keys (``<module>.weight`` codes + ``<module>.weight_scale``, fused experts stacked from
    per-expert ones), each quantized projection keeps its one weight parameter, now holding an ``MXFP4Weight``
    with the parameter's logical axes; the modules carry exactly the dense model's attributes (no ``*_scale``
    parameter, no mode bolted on); written back, the keys are Quark's again."""
    target = init_target(CONFIGS["moe"], dtype=jnp.float32, seed=2)
    _write_dense(target, tmp_path / "src")
    qcfg = QuantConfig(exclude=(*DEFAULT_EXCLUDE, "*.linear_attn.*"))
    quark.save_quark(quant.convert(target, True, qcfg), qcfg, tmp_path / "src", tmp_path / "q", dtype=jnp.float32)
    keys = set(checkpoint.checkpoint_files(tmp_path / "q"))
    assert {"model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.q_proj.weight_scale",
            "model.layers.0.mlp.experts.1.up_proj.weight", "model.layers.0.mlp.experts.1.up_proj.weight_scale",
            "model.layers.0.linear_attn.in_proj_qkv.weight"} <= keys
    assert "model.layers.0.linear_attn.in_proj_qkv.weight_scale" not in keys  # excluded: dense

    q = load_target(tmp_path / "q", dtype=jnp.float32, progress=False).module()
    q_proj, experts = q.model.layers[3].self_attn.q_proj, q.model.layers[0].mlp.experts
    w = q_proj.weight.get_value()
    assert isinstance(w, MXFP4Weight) and (w.codes.shape, w.scale.shape) == ((64, 16), (64, 1))
    assert q_proj.weight.get_metadata()["logical_axes"] == ("heads", None)
    assert isinstance(experts.gate_up_proj.get_value(), MXFP4Weight) and experts.gate_up_proj.shape == (4, 64, 32)
    assert not isinstance(q.model.layers[0].linear_attn.in_proj_qkv.weight.get_value(), MXFP4Weight)
    dense = dict(nnx.iter_graph(target.module()))
    for path, sub in nnx.iter_graph(q):
        if isinstance(sub, Linear | Experts):
            assert vars(sub).keys() == vars(dense[path]).keys(), path
    assert not hasattr(q_proj, "weight_scale") and not hasattr(experts, "gate_up_proj_scale")
    assert set(quark._tensors(quant.convert(target, True, qcfg), np.float32)) == keys


def test_mxfp4_gdn_rows_move_with_their_scales(tmp_path):
    """``in_proj_qkv``'s codes and per-row scales are rows of the GDN channel axis (held head-grouped):
    ``save_quark`` writes them in HF order, equal to the HF tensor quantized as it stands, and loaded
    they dequantize to the rows of the dense load (rows scaled by 2^0 .. 2^4, so a scale left behind
    its row would show)."""
    from safetensors.numpy import load_file

    target = init_target(CONFIGS["dense"], dtype=jnp.float32, seed=7)
    _write_dense(target, tmp_path / "src")
    key = "model.layers.0.linear_attn.in_proj_qkv.weight"
    tensors = quark._tensors(target, np.float32)
    tensors[key] = tensors[key] * 2.0 ** (np.arange(len(tensors[key])) % 5)[:, None]
    checkpoint.write_safetensors(tmp_path / "src" / "model.safetensors", tensors)
    qcfg = QuantConfig(exclude=DEFAULT_EXCLUDE)
    q = quant.convert(load_target(tmp_path / "src", dtype=jnp.float32, progress=False), True, qcfg)
    quark.save_quark(q, qcfg, tmp_path / "src", tmp_path / "out", dtype=jnp.float32)
    written = load_file(tmp_path / "out" / "model.safetensors")
    codes, scales = mxfp4.quantize_mxfp4(jnp.asarray(tensors[key]))
    np.testing.assert_array_equal(written[key], np.asarray(codes))
    np.testing.assert_array_equal(written[key + "_scale"], np.asarray(scales))
    assert len(np.unique(written[key + "_scale"])) > 1
    back = load_target(tmp_path / "out", dtype=jnp.float32, progress=False, quantized=False)
    want = quant.convert(q, False)
    layer = lambda t: t.params["model"]["layers"][0]["linear_attn"]["in_proj_qkv"]["weight"].get_value()  # noqa: E731
    np.testing.assert_array_equal(np.asarray(layer(back)), np.asarray(layer(want)))


def test_dense_checkpoint_quantized_at_load(tmp_path):
    target = init_target(CONFIGS["dense"], dtype=jnp.float32, seed=6)
    _write_dense(target, tmp_path / "src")
    q = load_target(tmp_path / "src", dtype=jnp.float32, progress=False, quantized=True)
    want = quant.convert(load_target(tmp_path / "src", dtype=jnp.float32, progress=False), True)
    for a, b in zip(jax.tree.leaves(q.params), jax.tree.leaves(want.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---------------------------------------------------------------------------------------------
# Config errors

_GOOD = QuantConfig().to_hf()


def _with(path, value):
    qc = json.loads(json.dumps(_GOOD))
    node = qc
    *parents, last = path.split(".")
    for p in parents:
        node = node[p]
    node[last] = value
    return {"quantization_config": qc}


@pytest.mark.parametrize("path,value,field", [
    ("quant_method", "gptq", "quantization_config.quant_method"),
    ("global_quant_config.weight.dtype", "int4", "global_quant_config.weight.dtype"),
    ("global_quant_config.weight.group_size", 16, "global_quant_config.weight.group_size"),
    ("global_quant_config.weight.scale_format", "fp8_e4m3", "global_quant_config.weight.scale_format"),
    ("global_quant_config.weight.qscheme", "per_channel", "global_quant_config.weight.qscheme"),
    ("global_quant_config.weight", [{"dtype": "fp8_e4m3"}, {"dtype": "int4"}], "global_quant_config.weight"),
    ("global_quant_config.input_tensors", {"dtype": "fp8_e4m3", "qscheme": "per_tensor"},
     "global_quant_config.input_tensors.dtype"),
    ("global_quant_config.input_tensors", {**_GOOD["global_quant_config"]["weight"], "is_dynamic": False},
     "global_quant_config.input_tensors.is_dynamic"),
    ("global_quant_config.output_tensors", {"dtype": "fp8_e4m3"}, "global_quant_config.output_tensors"),
    ("layer_quant_config", {"*down_proj": {}}, "quantization_config.layer_quant_config"),
    ("exclude", "lm_head", "quantization_config.exclude"),
])
def test_unsupported_quantization_config_names_the_field(path, value, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        QuantConfig.from_hf(_with(path, value), "x/config.json")


def test_config_without_input_tensors_is_weight_only_and_absent_is_dense():
    assert QuantConfig.from_hf({}) is None
    assert QuantConfig.from_hf({"quantization_config": _GOOD}).input_scale_mode is None
    on = _with("global_quant_config.input_tensors", {**_GOOD["global_quant_config"]["weight"], "is_dynamic": True})
    assert QuantConfig.from_hf(on).input_scale_mode == "floor"
    del on["quantization_config"]["global_quant_config"]["input_tensors"]["scale_calculation_mode"]
    assert QuantConfig.from_hf(on).input_scale_mode == "even"  # Quark's default rule


def _abstract(kind, mtp=False):
    return nnx.eval_shape(lambda: Qwen35ForCausalLM(CONFIGS[kind], mtp=mtp, rngs=nnx.Rngs(0)))


def test_exclude_must_keep_lm_head_and_whole_experts():
    model = _abstract("moe")
    with pytest.raises(ConfigError, match="lm_head"):
        quant.plan(model, QuantConfig(exclude=()))
    with pytest.raises(ConfigError, match="only some experts"):
        quant.plan(model, QuantConfig(exclude=("lm_head", "*.experts.1.*")))


def test_exclude_must_keep_the_mtp_head():
    model = _abstract("dense", mtp=True)
    with pytest.raises(ConfigError, match=r"mtp\.\*"):
        quant.plan(model, QuantConfig(exclude=("lm_head",)))


def test_quark_input_tensors_turn_activation_qdq_on(tmp_path):
    """A Quark config with dynamic MXFP4 ``input_tensors`` loads with activation quantize-dequantize in
    every quantized projection; the same bytes without it load weight-only."""
    target = init_target(CONFIGS["dense"], dtype=jnp.float32, seed=7)
    _write_dense(target, tmp_path / "src")
    qcfg = QuantConfig(input_scale_mode="even")
    quark.save_quark(quant.convert(target, True, qcfg), qcfg, tmp_path / "src", tmp_path / "on", dtype=jnp.float32)
    raw = json.loads((tmp_path / "on" / "config.json").read_text())
    assert raw["quantization_config"]["global_quant_config"]["input_tensors"]["is_dynamic"] is True
    on = load_target(tmp_path / "on", dtype=jnp.float32, progress=False)
    assert quant.layout(on.module())["input_scale_mode"] == "even"
    del raw["quantization_config"]["global_quant_config"]["input_tensors"]
    (tmp_path / "on" / "config.json").write_text(json.dumps(raw))
    off = load_target(tmp_path / "on", dtype=jnp.float32, progress=False)
    assert quant.layout(off.module())["input_scale_mode"] is None
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 32)), jnp.float32)
    lin_on, lin_off = on.module().model.layers[0].mlp.up_proj, off.module().model.layers[0].mlp.up_proj
    np.testing.assert_array_equal(np.asarray(lin_on(x)), np.asarray(lin_off(mxfp4.qdq_mxfp4(x, "even"))))
    assert not np.array_equal(np.asarray(lin_on(x)), np.asarray(lin_off(x)))



def _tree(root):
    return {f.relative_to(root).as_posix(): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()}


def test_an_output_that_holds_the_source_is_refused(tmp_path, capsys, monkeypatch):
    """``out`` the source, its parent (an earlier checkpoint there: replaceable) or a symlink to the parent:
    writing would delete the source checkpoint, so save_quark refuses, and ``dflash-jax quantize`` before it
    loads anything, naming both paths."""
    from dflash_jax import cli
    from dflash_jax.io import atomic
    from dflash_jax.models import target as target_module

    target = init_target(CONFIGS["dense"], dtype=jnp.float32, seed=7)
    src = tmp_path / "parent" / "src"
    _write_dense(target, src)
    (tmp_path / "parent" / "config.json").write_text("{}")
    (tmp_path / "link").symlink_to(tmp_path / "parent")
    before = _tree(tmp_path / "parent")
    q = quant.convert(target, True)
    for out in (src, tmp_path / "parent", tmp_path / "link"):
        with pytest.raises(atomic.WriteError, match=f"{out} is or holds the source checkpoint {src}"):
            quark.save_quark(q, QuantConfig(), src, out, dtype=jnp.float32)
        assert _tree(tmp_path / "parent") == before
    monkeypatch.setattr(target_module, "load_target", lambda *a, **k: pytest.fail("loaded before the check"))
    for out in (src, tmp_path / "parent", tmp_path / "link"):
        assert cli.main(["quantize", "--model", str(src), "--out", str(out), "--quiet"]) == 2
        assert f"{out} is or holds the source checkpoint {src}" in capsys.readouterr().err
        assert _tree(tmp_path / "parent") == before


@pytest.mark.slow
def test_cli_quantize_then_generate(tmp_path, capsys):
    """``dflash-jax quantize`` writes the Quark layout; ``generate --model`` on it decodes exactly as the
    quantized target loaded from Python does."""
    from dflash_jax import cli
    from dflash_jax.frontend import ASSETS, encode, load_tokenizer

    cfg = TargetConfig(**{**_COMMON, "vocab_size": 4096}, intermediate_size=64)  # the shipped tokenizer's vocab
    _write_dense(init_target(cfg, dtype=jnp.float32, seed=8), tmp_path / "src")
    raw = json.loads((tmp_path / "src" / "config.json").read_text())
    (tmp_path / "src" / "config.json").write_text(json.dumps({**raw, "vocab_size": 4096}))
    out = tmp_path / "q"
    assert cli.main(["quantize", "--model", str(tmp_path / "src"), "--out", str(out), "--exclude", "*.self_attn.*",
                     "--quiet"]) == 0
    assert "projections MXFP4" in capsys.readouterr().out
    assert "*.self_attn.*" in json.loads((out / "config.json").read_text())["quantization_config"]["exclude"]
    tok = str(ASSETS / "target")
    assert cli.main(["generate", "def f(x):", "--model", str(out), "--tokenizer", tok, "--max-new-tokens", "6",
                     "--block-size", "1", "--ignore-eos", "--chat-template", "off", "--no-compare", "--json",
                     "--quiet"]) == 0
    got = json.loads(capsys.readouterr().out)["completions"][0]["tokens"]
    q = load_target(out, dtype=jnp.float32, progress=False)
    assert any(".mlp." in n for n in quant.layout(q.module())["quantized"])
    prompt = encode(load_tokenizer(tok), "def f(x):", "off")
    assert generate(q, [prompt], block_size=1, max_new_tokens=6, stop_ids=()).token_lists()[0] == got


@pytest.mark.slow
def test_quantized_layers_run_the_pallas_kernels(pair):
    """The model path of the Pallas kernels (Pallas interpreter on a CPU) equals the dequantizing
    reference: a quantized MLP (MoE: routed MXFP4 experts + shared expert) and a GDN projection."""
    kind, _, q = pair
    layer = q.module().model.layers[1]
    x = jnp.asarray(np.random.default_rng(9).standard_normal((1, 3, 32)), jnp.float32)
    for module in (layer.mlp, layer.linear_attn.in_proj_qkv):
        ref = with_kernels(module, "reference")(x)
        np.testing.assert_allclose(np.asarray(with_kernels(module, "interpret")(x)), np.asarray(ref),
                                   rtol=1e-5, atol=1e-6)
