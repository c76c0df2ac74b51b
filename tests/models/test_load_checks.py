"""Checkpoints that must be refused before they can hang the loader or be read wrong (issue 25): exclude
patterns that backtrack, layer counts the checkpoint does not hold, paths outside the checkpoint, and tensors
stored in a dtype their parameter cannot take as is."""

from __future__ import annotations

import json
import time

import jax.numpy as jnp
import numpy as np
import pytest
from watchdog import Hang, watchdog

from dflash_jax.config import ConfigError, QuantConfig
from dflash_jax.io import atomic, checkpoint
from dflash_jax.io.checkpoint import CheckpointError
from dflash_jax.models import quant, quark
from dflash_jax.models.target import init_target, load_target
from dflash_jax.train.lm import hf_config, small_config

CFG = small_config(vocab_size=64, eos_id=0, hidden=32, layers=4, intermediate=64, heads=2, kv_heads=1, head_dim=16,
                   linear_key_heads=1, linear_value_heads=2, linear_head_dim=16, mtp_layers=0)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """A 4-layer dense checkpoint (every projection width a multiple of 32) and its target."""
    path = tmp_path_factory.mktemp("dense")
    target = init_target(CFG, seed=1)
    (path / "config.json").write_text(json.dumps(hf_config(CFG)))
    checkpoint.write_safetensors(path / "model.safetensors", quark._tensors(target, np.float32))
    return path, target


@pytest.fixture(scope="module")
def mxfp4(dense, tmp_path_factory):
    path, target = dense
    out = tmp_path_factory.mktemp("q") / "mxfp4"
    qcfg = QuantConfig()
    quark.save_quark(quant.convert(target, True, qcfg), qcfg, path, out, dtype=jnp.float32)
    return out


def _rewrite(src, dst, change):
    """A copy of checkpoint ``src`` at ``dst`` with its tensors (a dict) passed through ``change``."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    entries = checkpoint._entries(checkpoint.checkpoint_files(src))
    with open(src / "model.safetensors", "rb") as f:
        tensors = {k: checkpoint._read(f, e).copy() for k, e in entries.items()}
    checkpoint.write_safetensors(dst / "model.safetensors", change(tensors))
    return dst


def test_mxfp4_scales_stored_as_floats_are_refused_not_cast(mxfp4, tmp_path):
    key = "model.layers.0.mlp.down_proj.weight_scale"
    bad = _rewrite(mxfp4, tmp_path / "f32", lambda t: {**t, key: t[key].astype(np.float32)})
    with pytest.raises(CheckpointError, match=rf"'{key}' in .*: stored as F32, but '{key}' must be U8"):
        load_target(bad, jnp.float32, progress=False)
    codes = "model.layers.0.mlp.down_proj.weight"
    bad = _rewrite(mxfp4, tmp_path / "i8", lambda t: {**t, codes: t[codes].view(np.int8)})
    with pytest.raises(CheckpointError, match=rf"'{codes}' .* stored as I8, but '{codes}' must be U8"):
        load_target(bad, jnp.float32, progress=False)
    load_target(mxfp4, jnp.float32, progress=False)  # the file as written loads


def _with_exclude(mxfp4, tmp_path, pattern):
    raw = json.loads((mxfp4 / "config.json").read_text())
    raw["quantization_config"]["exclude"].append(pattern)
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(raw))
    (path / "model.safetensors").symlink_to(mxfp4 / "model.safetensors")
    return path


def test_backtracking_exclude_pattern_cannot_hang_the_loader(mxfp4, tmp_path, monkeypatch):
    """Python's re backtracks exponentially on (.|.)*X$ (it does not finish here); the loader matches with a
    time limit and finishes. A match that runs past the limit is a ConfigError naming the pattern and file."""
    import re

    from dflash_jax import config

    name = "model.language_model.layers.0.linear_attn.in_proj_qkvz"
    with pytest.raises(Hang), watchdog(1):
        re.match("(.|.)*X$", name)
    path = _with_exclude(mxfp4, tmp_path, "re:(.|.)*X$")
    with watchdog(60):
        load_target(path, jnp.float32, progress=False)

    class Slow:
        def match(self, name, timeout):
            raise TimeoutError("regex time-out")

    monkeypatch.setattr(config, "_regex", lambda pattern: Slow())
    with watchdog(60), pytest.raises(ConfigError, match=r"config.json: exclude pattern 're:\(\.\|\.\)\*X\$' took "
                                                         r"over .* s to match"):
        load_target(path, jnp.float32, progress=False)


@pytest.mark.parametrize("pattern", ["re:(unclosed", "re:*x", "re:a{2,1}"])
def test_invalid_exclude_regex_is_a_config_error(mxfp4, tmp_path, pattern):
    path = _with_exclude(mxfp4, tmp_path, pattern)
    with pytest.raises(ConfigError, match=r"config.json: quantization_config.exclude: .* not a valid regular"):
        load_target(path, jnp.float32, progress=False)
    with pytest.raises(ConfigError, match="not a valid regular expression"):
        QuantConfig(exclude=(pattern,))


def test_a_layer_count_the_checkpoint_does_not_hold_fails_fast(dense, tmp_path):
    src, _ = dense
    path = tmp_path / "deep"
    path.mkdir()
    cfg = hf_config(CFG)
    cfg.update(num_hidden_layers=2000, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 500)
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "model.safetensors").symlink_to(src / "model.safetensors")
    t0 = time.perf_counter()
    with watchdog(60), pytest.raises(CheckpointError, match=r"num_hidden_layers=2000, but the checkpoint holds "
                                                            r"tensors of 4 decoder layers .*missing layers 4\.\.1999"):
        load_target(path, jnp.float32, progress=False)
    assert time.perf_counter() - t0 < 30


def test_the_abstract_build_is_linear_in_the_layer_count():
    """Built per layer kind: 256 layers take about 16 times as long as 16 (the single trace took ~n^2)."""
    from dflash_jax.models.target import _abstract_model

    def build(n):
        cfg = small_config(vocab_size=64, eos_id=0, hidden=32, layers=n, intermediate=32, heads=2, kv_heads=1,
                           head_dim=16, linear_key_heads=1, linear_value_heads=1, linear_head_dim=16)
        t0 = time.perf_counter()
        model = _abstract_model(cfg, jnp.float32, False, "reference")
        assert len(model.model.layers) == n
        return time.perf_counter() - t0

    build(8)  # warm
    with watchdog(120):
        small, large = min(build(16) for _ in range(2)), build(256)
    assert large < 40 * max(small, 0.05), (small, large)  # quadratic would be ~256x


def test_index_and_manifest_paths_outside_the_checkpoint_are_refused_untouched(tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../../etc/hostname"}}))
    touched = []
    real_resolve = type(path).resolve

    def resolve(self, *a, **k):
        if "hostname" in str(self):
            touched.append(self)
        return real_resolve(self, *a, **k)

    monkeypatch.setattr(type(path), "resolve", resolve)
    with pytest.raises(CheckpointError, match="'../../etc/hostname' points outside the checkpoint directory"):
        checkpoint.checkpoint_files(path)
    (path / atomic.MANIFEST).write_text(json.dumps({"format": 1, "files": {"../../etc/hostname": {"size": 1}}}))
    with pytest.raises(atomic.IntegrityError, match=r"lists '../../etc/hostname', which is outside"):
        atomic.verify_manifest(path)
    (path / atomic.MANIFEST).write_text(json.dumps({"format": 1, "files": {"/etc/hostname": {"size": 1}}}))
    with pytest.raises(atomic.IntegrityError, match=r"lists '/etc/hostname', which is outside"):
        atomic.verify_manifest(path)
    assert touched == []


def test_a_drafter_layer_count_the_checkpoint_does_not_hold_fails_fast(dense, tmp_path):
    from dflash_jax.models.drafter import init_drafter, load_drafter, save_drafter
    from dflash_jax.train.drafter import drafter_config

    _, target = dense
    cfg = drafter_config(target.cfg, num_layers=1, taps=(1, 3), mask_token_id=1, block_size=4, heads=2, kv_heads=1,
                         head_dim=16, intermediate=32)
    save_drafter(tmp_path / "d", init_drafter(cfg))
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    (tmp_path / "d" / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 500,
                                                            "layer_types": ["full_attention"] * 500}))
    with watchdog(60), pytest.raises(CheckpointError, match="num_hidden_layers=500, but the checkpoint holds tensors "
                                                            "of 1 decoder layers"):
        load_drafter(tmp_path / "d", target, progress=False)


def test_a_drafter_trained_on_a_target_of_another_depth_is_refused(dense, tmp_path):
    """z-lab's num_target_layers is the depth of the target the drafter was trained on (its taps index that
    target's layers): a drafter saying 8 is refused on the 4-layer target, by ``load_drafter`` and by the
    command line's loader, with the field and both numbers, before its weights are read."""
    import dataclasses

    from dflash_jax import frontend
    from dflash_jax.models.drafter import init_drafter, load_drafter, save_drafter
    from dflash_jax.train.drafter import drafter_config

    path, target = dense
    cfg = drafter_config(target.cfg, num_layers=1, taps=(1, 2, 3), mask_token_id=1, block_size=4, heads=2, kv_heads=1,
                         head_dim=16, intermediate=32)
    save_drafter(tmp_path / "ok", init_drafter(cfg))
    assert load_drafter(tmp_path / "ok", target, progress=False).cfg.num_target_layers == 4
    save_drafter(tmp_path / "d", init_drafter(dataclasses.replace(cfg, num_target_layers=8)))
    (tmp_path / "d" / "model.safetensors").write_bytes(b"")  # never read
    message = r"drafter num_target_layers 8 != target num_hidden_layers 4: the drafter was trained on a target of 8 "
    with pytest.raises(ConfigError, match=message):
        load_drafter(tmp_path / "d", target, progress=False)
    with pytest.raises(ConfigError, match=message):
        frontend.load_models(path, tmp_path / "d", [frontend.parse_method("dflash:4")], dtype=jnp.float32,
                             progress=False)
