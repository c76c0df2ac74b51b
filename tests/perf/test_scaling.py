"""Prefill and compile measurements (scaling.py) on tiny shapes: what they time and report, never how fast."""

from __future__ import annotations

import json

import jax.numpy as jnp
import pytest

from dflash_jax import cli
from dflash_jax.kernels.attention import prefill_keys_scored
from dflash_jax.perf import regime, scaling, synthetic

# width 32, 4 layers (3 Gated DeltaNet + 1 attention), MLP 64; 2 query heads over 1 KV head of 16
TINY = (regime._hybrid(32, 4, 64, (2, 1, 16), (1, 2, 16)), regime._drafter(32, 4, (2, 1, 16), 64))


def test_prefill_table_is_linear_against_the_first_length():
    rows = [dict(length=8, median_s=1.0, min_s=0.5, max_s=2.0, ms_per_token=125.0, compile_s=3.0, flops=10.0,
                 scores_bytes=2**20),
            dict(length=16, median_s=4.0, min_s=4.0, max_s=4.0, ms_per_token=250.0, compile_s=3.0, flops=30.0,
                 scores_bytes=2**21)]
    lines = scaling.format_prefill(rows).splitlines()
    assert lines[2] == "| 8 | 1000.0 (500.0-2000.0) | 125.000 | 1.00x | 1.00x | 3.0 | 1 MiB |"
    # 4 s where linear says 2 s; 30 FLOPs where linear says 20
    assert lines[3].startswith("| 16 | 4000.0 (4000.0-4000.0) | 250.000 | 2.00x | 1.50x |")


def test_prefill_scores_only_the_keys_each_chunk_sees():
    """600 queries from position 0 over 856 cache rows, in 256-query chunks: 256 x 256 + 256 x 512 + 88 x 600
    scores, against 600 x 856 in one pass; up to 256 queries it is one pass over the whole capacity."""
    assert prefill_keys_scored(600, 856) == 256 * 256 + 256 * 512 + 88 * 600
    assert prefill_keys_scored(200, 456) == 200 * 456
    assert prefill_keys_scored(8192, 8448) < 0.52 * 8192 * 8448  # about half the quadratic term


def test_depth_configs_keep_the_widths_and_spread_the_taps():
    raw_target, raw_drafter = synthetic.REAL_SHAPES["27b"]
    t, d = scaling.depth_configs(raw_target, raw_drafter, 8)
    cfg, dcfg = synthetic.target_config(t), synthetic.drafter_config(d)
    assert cfg.num_hidden_layers == 8 and cfg.hidden_size == 5120
    assert cfg.layer_types.count("full_attention") == 2
    assert dcfg.target_layer_ids == (1, 2, 3, 4, 5) and dcfg.num_target_layers == 8
    t64, d64 = scaling.depth_configs(raw_target, raw_drafter, 64)
    assert synthetic.drafter_config(d64).target_layer_ids == (1, 16, 31, 46, 61)  # the real drafter's taps
    with pytest.raises(ValueError, match="multiple of the attention interval 4"):
        scaling.depth_configs(raw_target, raw_drafter, 6)


def test_loop_compile_is_timed_in_stages():
    r = scaling.loop_compile_seconds(*TINY, block=4, prompt_len=8, max_new=8, dtype=jnp.float32)
    assert r["layers"] == 4 and r["stablehlo_ops"] > 100
    assert min(r["trace_s"], r["lower_s"], r["compile_s"], r["cpu_s"]) > 0
    assert r["total_s"] == pytest.approx(r["trace_s"] + r["lower_s"] + r["compile_s"])


def test_command_times_each_prefill_length_apart(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(scaling, "prefill_target", lambda name: synthetic.random_target(TINY[0], dtype=jnp.float32))
    out = tmp_path / "s.json"
    assert cli.main(["scaling", "--lengths", "8,16", "--repeats", "2", "--layers", "", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| 8 |" in text and "| 16 |" in text and "DFlash loop" not in text
    rows = json.loads(out.read_text())["prefill"]["rows"]
    assert [r["length"] for r in rows] == [8, 16]
    for r in rows:
        assert 0 < r["min_s"] <= r["median_s"] <= r["max_s"] and r["compile_s"] >= 0
        assert r["ms_per_token"] == pytest.approx(1e3 * r["median_s"] / r["length"])
        assert r["flops"] > 2 * r["length"] * 32 * 3 * 64  # at least every token through the layers' MLPs
        assert r["scores_bytes"] == 4 * 2 * r["length"] * (r["length"] + scaling.EXTRA)  # [B=1, N=2, P, P + 256] f32
