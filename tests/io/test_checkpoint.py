"""Safetensors loading (both layouts, sharded, every error) and orbax round trips, on CPU."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dflash_jax.io.checkpoint import (
    CheckpointError,
    checkpoint_files,
    load_state,
    read_safetensors_header,
    restore_params,
    save_params,
    write_safetensors,
)

torch = pytest.importorskip("torch")
safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402
from safetensors.numpy import load_file as np_load_file  # noqa: E402
from safetensors.torch import save_file as torch_save_file  # noqa: E402


def spec(tensors):
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in tensors.items()}


def bits(a):
    """Bit pattern of an array, for exact comparisons that also hold for NaNs and bf16."""
    a = np.asarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}")) if a.dtype.kind == "f" or a.dtype == jnp.bfloat16 else a


def assert_same(got, want):
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        np.testing.assert_array_equal(bits(got[k]), bits(want[k]), err_msg=k)


@pytest.fixture
def small():
    rng = np.random.default_rng(0)
    return {
        "f32": rng.standard_normal((3, 5)).astype(np.float32),
        "bf16": rng.standard_normal((4, 2)).astype(ml_dtypes.bfloat16),
        "f16": rng.standard_normal((7,)).astype(np.float16),
        "i32": rng.integers(-100, 100, (2, 3, 2)).astype(np.int32),
        "scalar": np.array(2.5, np.float32),
    }


# ---------------------------------------------------------------- format round trips


def test_write_then_load_round_trip(tmp_path, small):
    write_safetensors(tmp_path / "model.safetensors", small, metadata={"format": "np"})
    header, data_start = read_safetensors_header(tmp_path / "model.safetensors")
    assert header["__metadata__"] == {"format": "np"} and data_start % 8 == 0
    assert set(checkpoint_files(tmp_path)) == set(small)
    assert_same(load_state(tmp_path, spec(small), progress=False), small)


def test_load_casts_to_expected_dtype(tmp_path, small):
    write_safetensors(tmp_path / "model.safetensors", small)
    want = {"f32": jax.ShapeDtypeStruct((3, 5), jnp.bfloat16),
            "bf16": jax.ShapeDtypeStruct((4, 2), jnp.float32)}
    got = load_state(tmp_path, want, ignore=["f16", "i32", "scalar"], progress=False)
    assert got["f32"].dtype == jnp.bfloat16 and got["bf16"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got["f32"]), small["f32"].astype(ml_dtypes.bfloat16))
    np.testing.assert_array_equal(np.asarray(got["bf16"]), small["bf16"].astype(np.float32))


def test_safetensors_package_reads_our_file(tmp_path, small):
    write_safetensors(tmp_path / "x.safetensors", small)
    # numpy has no bf16, so the numpy loader gets the other dtypes; torch checks the bf16 file.
    write_safetensors(tmp_path / "plain.safetensors", {k: v for k, v in small.items() if k != "bf16"})
    for k, v in np_load_file(tmp_path / "plain.safetensors").items():
        np.testing.assert_array_equal(v, small[k])
        assert v.dtype == small[k].dtype
    with safe_open(tmp_path / "x.safetensors", framework="pt") as f:
        t = f.get_tensor("bf16")
        assert t.dtype == torch.bfloat16
        np.testing.assert_array_equal(t.float().numpy(), small["bf16"].astype(np.float32))


def test_we_read_torch_written_bf16(tmp_path):
    torch.manual_seed(0)
    ts = {"w": torch.randn(6, 3, dtype=torch.bfloat16), "b": torch.randn(3), "n": torch.arange(4)}
    torch_save_file(ts, tmp_path / "model.safetensors")
    dtypes = {torch.bfloat16: jnp.bfloat16, torch.float32: jnp.float32, torch.int64: jnp.int32}
    want = {k: jax.ShapeDtypeStruct(tuple(v.shape), dtypes[v.dtype]) for k, v in ts.items()}
    got = load_state(tmp_path, want, progress=False)
    for k, v in ts.items():
        np.testing.assert_array_equal(np.asarray(got[k]).astype(np.float64), v.double().numpy())
    assert np.array_equal(bits(got["w"]).view(np.int16), ts["w"].view(torch.int16).numpy())


# ---------------------------------------------------------------- a real tiny HF MoE model


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    """A saved Qwen3_5MoeForCausalLM (per-expert keys on disk) and its state dict (fused layout)."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(0)
    cfg = Qwen3_5MoeTextConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, tie_word_embeddings=False,
    )
    model = Qwen3_5MoeForCausalLM(cfg)
    path = tmp_path_factory.mktemp("hf") / "causal"
    model.save_pretrained(path)
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 32, 32)
    assert state["model.layers.0.mlp.experts.down_proj"].shape == (8, 32, 16)
    return path, state


def test_hf_per_expert_checkpoint_loads_fused(hf_moe):
    path, state = hf_moe
    on_disk = set(checkpoint_files(path))
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in on_disk
    assert "model.layers.0.mlp.experts.gate_up_proj" not in on_disk
    assert_same(load_state(path, spec(state), progress=False), state)


def test_conditional_generation_layout_and_sharded(hf_moe, tmp_path):
    path, state = hf_moe
    # ConditionalGeneration layout: model.language_model.* prefix, fused experts, plus a vision tower.
    vl = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
          for k, v in state.items()}
    vl["model.visual.blocks.0.x"] = np.ones((2, 2), np.float32)
    (tmp_path / "vl").mkdir()
    write_safetensors(tmp_path / "vl" / "model.safetensors", vl)
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.visual\.blocks\.0\.x'"):
        load_state(tmp_path / "vl", spec(state), progress=False)
    assert_same(load_state(tmp_path / "vl", spec(state), ignore=[r"model\.visual\."], progress=False), state)

    # The per-expert file split over two shards with an index.
    shard = tmp_path / "sharded"
    shard.mkdir()
    per_expert = {}
    with safe_open(path / "model.safetensors", framework="np") as f:
        for k in f.keys():
            per_expert[k] = f.get_tensor(k)
    keys = sorted(per_expert)
    halves = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, ks in halves.items():
        write_safetensors(shard / name, {k: per_expert[k] for k in ks})
    weight_map = {k: name for name, ks in halves.items() for k in ks}
    index = {"metadata": {}, "weight_map": weight_map}
    (shard / "model.safetensors.index.json").write_text(json.dumps(index))
    assert checkpoint_files(shard) == {k: shard / v for k, v in weight_map.items()}
    assert_same(load_state(shard, spec(state), progress=False), state)

    # bf16 target params from the f32 file, placed through a custom `place`.
    seen = []
    want = {k: jax.ShapeDtypeStruct(v.shape, jnp.bfloat16) for k, v in state.items()}
    got = load_state(shard, want, place=lambda k, a: seen.append(k) or jnp.asarray(a), progress=False)
    assert sorted(seen) == sorted(state) and got["lm_head.weight"].dtype == jnp.bfloat16


# ---------------------------------------------------------------- errors


@pytest.fixture
def moe_dir(tmp_path):
    """A tiny per-expert MoE layer: E=3, I=2, D=4."""
    rng = np.random.default_rng(1)
    t = {"model.norm.weight": rng.standard_normal(4).astype(np.float32)}
    for e in range(3):
        for proj, shape in (("gate_proj", (2, 4)), ("up_proj", (2, 4)), ("down_proj", (4, 2))):
            t[f"model.layers.0.mlp.experts.{e}.{proj}.weight"] = rng.standard_normal(shape).astype(np.float32)
    write_safetensors(tmp_path / "model.safetensors", t)
    expected = {
        "model.norm.weight": jax.ShapeDtypeStruct((4,), jnp.float32),
        "model.layers.0.mlp.experts.gate_up_proj": jax.ShapeDtypeStruct((3, 4, 4), jnp.float32),
        "model.layers.0.mlp.experts.down_proj": jax.ShapeDtypeStruct((3, 4, 2), jnp.float32),
    }
    return tmp_path, t, expected


def test_per_expert_stacking_order(moe_dir):
    path, t, expected = moe_dir
    got = load_state(path, expected, progress=False)
    for e in range(3):
        p = f"model.layers.0.mlp.experts.{e}."
        gu = np.asarray(got["model.layers.0.mlp.experts.gate_up_proj"][e])
        np.testing.assert_array_equal(gu[:2], t[p + "gate_proj.weight"])  # gate half first
        np.testing.assert_array_equal(gu[2:], t[p + "up_proj.weight"])
        down = got["model.layers.0.mlp.experts.down_proj"][e]
        np.testing.assert_array_equal(down, t[p + "down_proj.weight"])


def test_missing_tensor(moe_dir):
    path, _, expected = moe_dir
    expected = {**expected, "lm_head.weight": jax.ShapeDtypeStruct((8, 4), jnp.float32)}
    with pytest.raises(CheckpointError, match=r"missing tensor 'lm_head\.weight' with shape \(8, 4\)"):
        load_state(path, expected, progress=False)


def test_unexpected_tensor(moe_dir):
    path, _, expected = moe_dir
    del expected["model.norm.weight"]
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.norm\.weight' in model\.safe"):
        load_state(path, expected, progress=False)
    assert "model.norm.weight" not in load_state(path, expected, ignore=[r"model\.norm\."], progress=False)


def test_shape_mismatch(moe_dir):
    path, _, expected = moe_dir
    expected["model.norm.weight"] = jax.ShapeDtypeStruct((5,), jnp.float32)
    msg = r"shape mismatch for 'model\.norm\.weight': expected \(5,\), found \(4,\)"
    with pytest.raises(CheckpointError, match=msg):
        load_state(path, expected, progress=False)
    expected["model.norm.weight"] = jax.ShapeDtypeStruct((4,), jnp.float32)
    expected["model.layers.0.mlp.experts.down_proj"] = jax.ShapeDtypeStruct((3, 4, 3), jnp.float32)
    with pytest.raises(CheckpointError, match=r"shape mismatch for 'model\.layers\.0\.mlp\.experts\.0\.down"):
        load_state(path, expected, progress=False)


def test_missing_per_expert_tensor(moe_dir):
    path, t, expected = moe_dir
    del t["model.layers.0.mlp.experts.1.up_proj.weight"]
    del t["model.layers.0.mlp.experts.2.up_proj.weight"]
    write_safetensors(path / "model.safetensors", t)
    msg = r"missing tensor 'model\.layers\.0\.mlp\.experts\.1\.up_proj\.weight'"
    with pytest.raises(CheckpointError, match=msg):
        load_state(path, expected, progress=False)
    # An expert index beyond E is an unexpected tensor.
    expected["model.layers.0.mlp.experts.gate_up_proj"] = jax.ShapeDtypeStruct((1, 4, 4), jnp.float32)
    expected["model.layers.0.mlp.experts.down_proj"] = jax.ShapeDtypeStruct((1, 4, 2), jnp.float32)
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.experts\.2\.gate"):
        load_state(path, expected, progress=False)


def test_duplicate_after_prefix_normalisation(moe_dir):
    path, t, expected = moe_dir
    t["model.language_model.norm.weight"] = t["model.norm.weight"]
    write_safetensors(path / "model.safetensors", t)
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' appears twice"):
        load_state(path, expected, progress=False)


def test_missing_shard(moe_dir):
    path, _, expected = moe_dir
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    shutil.move(path / "model.safetensors", path / first)
    weight_map = dict.fromkeys(checkpoint_files(path / first), first)
    weight_map["model.norm.weight"] = second
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=r"shard model-00002-of-00002\.safetensors .*index\.json"):
        load_state(path, expected, progress=False)


def test_truncated_file(moe_dir):
    path, _, expected = moe_dir
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[:-5])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated"):
        load_state(path, expected, progress=False)
    (path / "model.safetensors").write_bytes(data[:5])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated"):
        read_safetensors_header(path / "model.safetensors")


def test_corrupt_header(moe_dir):
    path, _, expected = moe_dir
    data = bytearray((path / "model.safetensors").read_bytes())
    data[8:9] = b"#"  # the JSON's opening brace
    (path / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: cannot read safetensors header"):
        load_state(path, expected, progress=False)
    (path / "model.safetensors").write_bytes((10**9).to_bytes(8, "little") + bytes(data[8:]))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt or truncated header"):
        load_state(path, expected, progress=False)
    blob = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}).encode()
    (path / "model.safetensors").write_bytes(len(blob).to_bytes(8, "little") + blob + bytes(8))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt header entry 'w'"):
        load_state(path, expected, progress=False)


def _raw_file(path, entries: dict, data_len: int):
    blob = json.dumps(entries).encode()
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + bytes(data_len))


@pytest.mark.parametrize("entries, data_len, message", [
    ({"a": [0, 8], "b": [4, 12]}, 12, r"'b' \(data_offsets \[4, 12\]\) overlaps the previous tensor"),
    ({"a": [0, 8], "b": [0, 8]}, 8, "overlaps the previous tensor"),
    ({"a": [0, 8], "b": [12, 20]}, 20, "leaves a gap at byte 8"),
    ({"a": [0, 8], "b": [8, 16]}, 24, "tensors cover 16 of the 24 data bytes"),
])
def test_offsets_must_tile_the_data_as_safetensors_requires(tmp_path, entries, data_len, message):
    """Overlapping / gapped / short offsets: one tensor would read another's bytes. The safetensors library
    (the oracle) refuses the same files."""
    file = tmp_path / "model.safetensors"
    _raw_file(file, {k: {"dtype": "F32", "shape": [2], "data_offsets": o} for k, o in entries.items()}, data_len)
    with pytest.raises(CheckpointError, match=message):
        read_safetensors_header(file)
    with pytest.raises(Exception):  # noqa: B017 - the library raises its own SafetensorError
        with safe_open(str(file), "np") as f:
            [f.get_tensor(k) for k in f.keys()]


def test_offsets_in_any_key_order_are_fine(tmp_path):
    """Entries listed out of offset order but tiling the data: valid for the library, and for us."""
    file = tmp_path / "model.safetensors"
    _raw_file(file, {"b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},
                     "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 16)
    with safe_open(str(file), "np") as f:
        assert sorted(f.keys()) == ["a", "b"]
    assert set(load_state(tmp_path, {k: jax.ShapeDtypeStruct((2,), jnp.float32) for k in "ab"},
                          progress=False)) == {"a", "b"}


@pytest.mark.parametrize("stored", [np.int32, np.bool_, np.uint8])
def test_integer_or_bool_tensor_for_a_float_parameter(moe_dir, stored):
    path, t, expected = moe_dir
    t["model.norm.weight"] = np.ones(4, stored)
    write_safetensors(path / "model.safetensors", t)
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' in .*model\.safetensors: stored as "
                                              r"(I32|BOOL|U8), but 'model\.norm\.weight' is a floating-point"):
        load_state(path, expected, progress=False)
    # Per-expert pieces too.
    t["model.norm.weight"] = np.ones(4, np.float32)
    t["model.layers.0.mlp.experts.1.up_proj.weight"] = np.ones((2, 4), stored)
    write_safetensors(path / "model.safetensors", t)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.mlp\.experts\.1\.up_proj\.weight' in .*"
                                              r"stored as"):
        load_state(path, expected, progress=False)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_non_finite_weights_are_an_error(moe_dir, bad, dtype):
    path, t, expected = moe_dir
    expected = {k: jax.ShapeDtypeStruct(v.shape, dtype) for k, v in expected.items()}
    t["model.layers.0.mlp.experts.2.down_proj.weight"][1, 1] = bad
    write_safetensors(path / "model.safetensors", t)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.mlp\.experts\.down_proj' \(in "
                                              r"model\.safetensors\) holds NaN or Inf"):
        load_state(path, expected, progress=False)


def test_cast_overflow_is_caught(moe_dir):
    """A finite f32 weight too large for f16 becomes Inf in the cast: refused, not loaded."""
    path, t, expected = moe_dir
    t["model.norm.weight"][0] = 1e6
    write_safetensors(path / "model.safetensors", t)
    expected = {k: jax.ShapeDtypeStruct(v.shape, jnp.float16) for k, v in expected.items()}
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight'.*NaN or Inf .*after the cast to float16"):
        load_state(path, expected, progress=False)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/hostname", "sub/../../x.safetensors"])
def test_shard_paths_stay_inside_the_checkpoint(moe_dir, shard):
    path, _, expected = moe_dir
    weight_map = dict.fromkeys(checkpoint_files(path / "model.safetensors"), "model.safetensors")
    weight_map["model.norm.weight"] = shard
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=f"shard path {shard!r} points outside the checkpoint directory"):
        checkpoint_files(path)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["a"]}))
    with pytest.raises(CheckpointError, match="weight_map must map tensor names to shard file names"):
        checkpoint_files(path)


def test_no_safetensors(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=f"{tmp_path}: no model.safetensors"):
        load_state(tmp_path, {}, progress=False)


# ---------------------------------------------------------------- orbax


def test_orbax_round_trip(tmp_path):
    rng = np.random.default_rng(2)
    params = {
        "embed": jnp.asarray(rng.standard_normal((5, 3)), jnp.bfloat16),
        "layers": {"0": {"w": jnp.asarray(rng.standard_normal((3, 3)), jnp.float32),
                         "b": jnp.asarray(rng.standard_normal((3,)), jnp.bfloat16)}},
    }
    save_params(tmp_path / "ckpt", params)
    save_params(tmp_path / "ckpt", params)  # overwrites
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    back = restore_params(tmp_path / "ckpt", abstract)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(bits(a), bits(b))

    with pytest.raises(CheckpointError, match="no orbax checkpoint"):
        restore_params(tmp_path / "absent", abstract)
    wrong = {**abstract, "embed": jax.ShapeDtypeStruct((4, 3), jnp.bfloat16)}
    with pytest.raises(CheckpointError, match=r"embed: stored \(5, 3\), expected \(4, 3\)"):
        restore_params(tmp_path / "ckpt", wrong)
    with pytest.raises(CheckpointError, match=r"extra: stored absent"):
        restore_params(tmp_path / "ckpt", {**abstract, "extra": abstract["embed"]})


def test_orbax_save_is_atomic_and_verified(tmp_path, monkeypatch):
    from dflash_jax.io import atomic, checkpoint

    params = {"w": jnp.arange(6.0).reshape(2, 3)}
    abstract = {"w": jax.ShapeDtypeStruct((2, 3), jnp.float32)}
    save_params(tmp_path / "step_1", params)

    def fail(path, tree):
        (path.parent / "partial").write_text("x")
        raise KeyboardInterrupt
    monkeypatch.setattr(checkpoint, "save_orbax", fail)
    with pytest.raises(KeyboardInterrupt):
        save_params(tmp_path / "step_1", {"w": jnp.zeros((2, 3))})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]  # no temporary left behind
    np.testing.assert_array_equal(restore_params(tmp_path / "step_1", abstract)["w"], params["w"])
    victim = max((p for p in (tmp_path / "step_1").rglob("*") if p.is_file() and p.name != atomic.MANIFEST),
                 key=lambda p: p.stat().st_size)
    raw = victim.read_bytes()
    victim.write_bytes(raw[:-1] + bytes([raw[-1] ^ 0xFF]))
    with pytest.raises(CheckpointError, match="corrupt checkpoint .* does not match its checksum"):
        checkpoint.verify(tmp_path / "step_1", "checkpoint", checksums=True)
    victim.write_bytes(raw[:-1])  # a short file is caught before every restore
    with pytest.raises(CheckpointError, match=f"corrupt checkpoint .* has {len(raw) - 1} bytes"):
        restore_params(tmp_path / "step_1", abstract)


def test_converted_copy_is_atomic_and_checksummed(hf_dense, tmp_path, monkeypatch):
    from dflash_jax.io import atomic
    from dflash_jax.io import checkpoint as ck
    from dflash_jax.models.target import CONVERTED, load_target, save_converted

    _, src = hf_dense
    tg = load_target(src, dtype=jnp.float32, progress=False)
    out = tmp_path / "converted"
    save_converted(tg, src, out)
    leaf = jax.tree.leaves(tg.params)[0]

    def fail(path, tree):
        path.mkdir(parents=True)
        (path / "half").write_text("x")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(ck, "save_orbax", fail)
    with pytest.raises(OSError, match="No space left"):
        save_converted(tg, src, out)  # over the existing copy: it must survive
    monkeypatch.undo()
    again = load_target(out, progress=False)
    np.testing.assert_array_equal(jax.tree.leaves(again.params)[0], leaf)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["converted"]

    victim = max((p for p in (out / CONVERTED).rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    victim.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=f"corrupt conversion at {out}: .* does not match its checksum"):
        ck.verify(out, "conversion", checksums=True)
    victim.write_bytes(bytes(raw[:-1]))  # sizes are checked before every load
    with pytest.raises(CheckpointError, match=f"corrupt conversion at {out}: .* has {len(raw) - 1} bytes"):
        load_target(out, progress=False)
    (out / atomic.MANIFEST).unlink()  # what a copy whose write never finished looks like
    with pytest.raises(CheckpointError, match=f"incomplete conversion at {out}"):
        load_target(out, progress=False)
    save_converted(tg, src, out)  # an earlier copy, finished or not, may be replaced ...
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(atomic.WriteError, match="not a converted copy; refusing to replace it"):
        save_converted(tg, src, tmp_path / "mine")  # ... a folder of the user's not
    with pytest.raises(atomic.WriteError, match="holds the source checkpoint"):
        save_converted(tg, src, src)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
