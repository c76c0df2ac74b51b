"""The ``dflash-jax`` command line as a user meets it: the main job on the shipped models, and its errors.

Every bad input gives exit status 2 and one ``dflash-jax: error:`` line naming the flag the user gave,
never a traceback; settings that the chosen method would not use are refused, not dropped.
"""

from __future__ import annotations

import io
import json
import sys

import pytest

from dflash_jax import cli, frontend
from dflash_jax.cli import generate as cli_generate

ASSETS = frontend.ASSETS
shipped = pytest.mark.skipif(not (ASSETS / "target" / "config.json").is_file() or
                             not (ASSETS / "drafter" / "config.json").is_file(), reason="shipped models absent")


def _error(capsys, argv) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("dflash-jax: error: ") and "Traceback" not in err, err
    return err


@shipped
def test_generate_streams_and_summarises_on_the_shipped_models(capsys):
    assert cli.main(["generate", "def fibonacci(n):", "--max-new-tokens", "16", "--repeats", "1"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("def fibonacci(n):")
    # --block-size auto (the default) weighed both shipped drafters by cost, said why, and used the choice
    said = [line for line in err.splitlines() if line.startswith("[block size auto: ")]
    *progress, dflash, dflash2, why = said  # the phases as they start, each drafter's choice, then the weighing
    assert progress[0].startswith("[block size auto: calibrating")
    assert any(line.startswith("[block size auto: dflash2: calibrating") for line in progress)
    assert "dflash:16: " in dflash and "dflash2:16: " in dflash2  # what each commits a step, timed or not
    assert why.startswith("[block size auto: ") and "tokens a step commits: ar 1.00, dflash:16 " in why
    assert f"finish length, {why.split()[3]}, tau" in out
    assert "decode-only" in out and "tok/s" in out and "speed-up" in out and "end to end" in out
    assert "ceiling on this machine at tau" in out and "compile (apart)" in out and "WARNING" not in out


@shipped
def test_json_output_of_a_vllm_speculative_config(capsys):
    config = '{"method": "dflash", "model": "%s", "num_speculative_tokens": 3}' % (ASSETS / "drafter")
    assert cli.main(["generate", "import os", "--speculative-config", config, "--max-new-tokens", "8",
                     "--no-compare", "--quiet", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["method"] == "dflash:4" and doc["block"] == 4 and doc["timings"] is None
    (c,) = doc["completions"]
    assert c["prompt"] == "import os" and len(c["tokens"]) == 8 and c["finish_reason"] == "length"
    assert isinstance(c["text"], str) and 1 <= c["tau"] <= 4


@shipped
def test_prompts_file_stdin_and_stop_strings(tmp_path, capsys, monkeypatch):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ASSETS / "target"))
    base = ["generate", "--max-new-tokens", "12", "--no-compare", "--quiet", "--json", "--block-size", "1"]
    assert cli.main([*base, "def add(a, b):"]) == 0
    full = json.loads(capsys.readouterr().out)["completions"][0]
    stop = full["text"][len(full["text"]) // 2:][:3]  # a string from the middle of the greedy completion
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "def add(a, b):"}) + "\n\n" + json.dumps({"turns": ["import os"]}) + "\n")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(path.read_bytes())))
    assert cli.main([*base, "--prompts", "-", "--stop", stop]) == 0
    first, second = json.loads(capsys.readouterr().out)["completions"]
    assert first["finish_reason"] == "stop" and full["text"].startswith(first["text"] + stop)
    assert first["tokens"] == full["tokens"][:len(first["tokens"])] and stop not in first["text"]
    assert stop in tok.decode(first["tokens"]) and second["prompt"] == "import os"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"def add(a, b):")))
    assert cli.main([*base, "-", "--stop-ids", str(full["tokens"][0])]) == 0
    (only,) = json.loads(capsys.readouterr().out)["completions"]
    assert only["tokens"] == full["tokens"][:1] and only["finish_reason"] == "stop"


@shipped
def test_identical_work_reads_one(capsys):
    """--block-size 1 times plain decoding against itself: the same compiled program, timed the same way."""
    assert cli.main(["generate", "def f(x):", "--block-size", "1", "--max-new-tokens", "8", "--repeats", "2",
                     "--quiet", "--json"]) == 0
    t = json.loads(capsys.readouterr().out)["timings"]
    assert t["method"] == "ar" and t["same_tokens"] and t["ceiling"] == 1.0 and t["tokens"] == t["baseline_tokens"]
    assert t["repeats"] == 2 and set(t["decode_speedup"]) == {"median", "min", "max", "ci"}
    assert t["decode_speedup"]["min"] <= t["decode_speedup"]["ci"][0] <= t["decode_speedup"]["median"] \
        <= t["decode_speedup"]["ci"][1] <= t["decode_speedup"]["max"]


def test_errors_name_the_problem(tmp_path, capsys):
    assert f"--model {tmp_path / 'nowhere'}: no such directory" in _error(
        capsys, ["generate", "x", "--model", str(tmp_path / "nowhere")])
    assert "unknown method 'eagle'" in _error(capsys, ["generate", "x", "--speculative-config", '{"method": "eagle"}'])
    assert "not valid JSON" in _error(capsys, ["generate", "x", "--speculative-config", "{not json"])


@pytest.mark.parametrize("argv, match", [
    (["--speculative-config", "[1, 2]"], "--speculative-config must be a JSON object, got list"),
    (["--speculative-config", '"dflash"'], "--speculative-config must be a JSON object, got str"),
    (["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2.5}'],
     "num_speculative_tokens must be an integer, got 2.5"),
    (["--speculative-config", '{"method": "mtp", "num_speculative_tokens": "3"}'],
     "num_speculative_tokens must be an integer, got '3'"),
    (["--speculative-config", '{"method": "mtp", "num_speculative_tokens": true}'],
     "num_speculative_tokens must be an integer, got True"),
    (["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 0}'],
     "num_speculative_tokens 0 drafts nothing"),
    (["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 16}'], "must be in 1..15, got 16"),
    (["--speculative-config", '{"method": "mtp", "draft_tensor_parallel_size": 1}'],
     "unknown keys ['draft_tensor_parallel_size']"),
    (["--speculative-config", '{"method": "mtp", "model": "x"}'], 'drop "model"'),
    (["--speculative-config", '{"method": "dflash"}'], 'needs "model"'),
    (["--block-size", "0"], "--block-size must be >= 1"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--prompts", "p.jsonl"], "not both"),
])
def test_bad_flags_are_one_message_naming_the_flag(capsys, argv, match):
    assert match in _error(capsys, ["generate", "x", *argv])


@shipped
@pytest.mark.parametrize("argv, match", [
    (["--top-k", "100000"], "--top-k must be in 0.."),
    (["--stop-ids", "-1"], "--stop-ids [-1]: outside the vocabulary"),
    (["--block-size", "32"], "exceed the drafter's block size 16"),
    (["--block-size", "1", "--draft-model", str(ASSETS / "drafter")], "--draft-model would be unused"),
    (["--speculative-config", '{"method": "mtp"}', "--draft-model", str(ASSETS / "drafter")],
     "--draft-model is unused by mtp:3"),
    (["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}', "--block-size", "8"],
     "--block-size 8 disagrees with --speculative-config's num_speculative_tokens 3"),
    (["--speculative-config", '{"method": "dflash", "model": "/elsewhere"}', "--draft-model", str(ASSETS / "drafter")],
     "disagrees with --speculative-config's model /elsewhere"),
    (["--model", str(ASSETS / "target"), "--block-size", "4"], "--block-size 4 needs a drafter"),
    (["--tokenizer", str(ASSETS / "drafter")], "no tokenizer files in the folder"),
    (["--tokenizer", "/no/such/dir"], "--tokenizer /no/such/dir: not a directory"),
    (["--draft-model", str(ASSETS / "target")], "not a DFlash drafter config"),
])
def test_settings_that_disagree_or_go_unused_are_refused(capsys, argv, match):
    assert match in _error(capsys, ["generate", "x", "--no-compare", "--quiet", *argv])


@pytest.mark.parametrize("block_size, draft_model, spec, draft_block, name", [
    (None, None, None, 16, "dflash:16"),  # the shipped pair's default: the drafter's own block
    (4, "d", None, 16, "dflash:4"),
    (1, None, None, 16, "ar"),
    (None, None, {"method": "mtp"}, None, f"mtp:{cli_generate.MTP_DEFAULT_STEPS}"),
    (8, None, {"method": "mtp"}, None, "mtp:7"),  # block = drafts + 1
    (None, None, {"method": "dflash", "model": "d", "num_speculative_tokens": 3}, 16, "dflash:4"),
    (None, None, {"method": "dflash", "model": "d"}, 16, "dflash:16"),
])
def test_method_from_flags(block_size, draft_model, spec, draft_block, name):
    """generate's flags -> the method (``frontend.parse_method`` reads method strings; the names differ on purpose)."""
    import argparse

    args = argparse.Namespace(block_size=block_size, draft_model=draft_model)
    assert cli_generate.method_from_flags(args, spec, draft_block).name == name
    assert frontend.parse_method(name) == cli_generate.method_from_flags(args, spec, draft_block)


class _Counting:
    """A tokenizer whose decodes count the ids they read."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids_read = tokenizer, 0

    def decode(self, ids, **kw):
        self.ids_read += len(ids)
        return self.tokenizer.decode(ids, **kw)


def _shipped_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ASSETS / "target"))


def _stream(tokenizer, tokens, chunk, stops=()):
    """(TextStream after all chunks, the text shown step by step)."""
    text, shown = cli_generate.TextStream(tokenizer, stops), ""
    for i in range(0, len(tokens), chunk):
        text.extend(tokens[i:i + chunk])
        assert text.text.startswith(shown)  # shown text is never taken back
        shown = text.text[:text.settled]
        if text.stopped:
            break
    text.finish()
    return text, shown + text.text[len(shown):]


MULTIBYTE = "def café(naïve):\n    return '日本語 🎉 ü' * 2  # ¿qué? — ok\n" * 6


@pytest.mark.skipif(not (ASSETS / "target" / "tokenizer.json").is_file(), reason="shipped tokenizer absent")
@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_streamed_text_is_the_full_decode_and_incremental(chunk):
    """Multi-byte characters split over tokens, merged tokens, random ids (invalid UTF-8 mid-text, special
    tokens): the streamed text equals one decode of all tokens, and decoding reads O(n) ids, not O(n^2)."""
    import random

    tok = _shipped_tokenizer()
    rand = random.Random(chunk)
    for tokens in (tok.encode(MULTIBYTE, add_special_tokens=False),
                   [rand.randrange(len(tok)) for _ in range(300)]):
        full = tok.decode(tokens, skip_special_tokens=True)
        counting = _Counting(tok)
        text, shown = _stream(counting, tokens, chunk)
        assert text.text == full and shown == full and text.tokens == tokens
        assert counting.ids_read <= 8 * len(tokens), (counting.ids_read, len(tokens))
    assert len(tok.encode(MULTIBYTE)) > 100 and any(
        "\ufffd" in tok.decode([t]) for t in tok.encode(MULTIBYTE))  # characters do split over tokens


def _reference_stop(tok, tokens, stops):
    """The definition: (the first n whose decode holds a stop, that decode cut before its earliest stop), or None."""
    for n in range(1, len(tokens) + 1):
        text = tok.decode(tokens[:n], skip_special_tokens=True)
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return n, text[:min(hits)]
    return None


def _check_stops(tok, tokens, stops, chunks=(1, 5)):
    ref = _reference_stop(tok, tokens, stops)
    for chunk in chunks:
        text, shown = _stream(tok, tokens, chunk, stops)
        if ref is None:
            assert not text.stopped and text.text == tok.decode(tokens, skip_special_tokens=True) == shown
        else:
            assert text.stopped and (len(text.tokens), text.text) == ref and shown == text.text
            assert not any(s in shown for s in stops)


@pytest.mark.skipif(not (ASSETS / "target" / "tokenizer.json").is_file(), reason="shipped tokenizer absent")
@pytest.mark.parametrize("stops", [("日本",), ("* 2", "ü'"), ("return", "turn '日"), ("🎉",), ("\n\n",)])
def test_stop_strings_end_at_the_token_completing_them(stops):
    """Against the definition: the first n whose decode holds a stop; the text ends before the earliest one."""
    tok = _shipped_tokenizer()
    _check_stops(tok, tok.encode(MULTIBYTE, add_special_tokens=False), stops)


class _ByteTokenizer:
    """Byte-level tokens by hand: an id is a byte string that may end inside a character (Qwen's vocabulary
    has such tokens, e.g. a space and the first byte of a CJK character); decoding joins the bytes and
    replaces invalid UTF-8, as the ByteLevel decoder does."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids, **kw):
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", "replace")


def test_a_token_that_completes_a_stop_and_starts_a_character():
    tok = _ByteTokenizer([b"x", b" \xe6", b"\x97\xa5", b"y"])  # [0, 1, 2, 3] decodes to "x 日y"
    _check_stops(tok, [0, 1, 2, 3], ("x ",))  # complete at token 1, whose second byte starts 日
    assert _reference_stop(tok, [0, 1, 2, 3], ("x ",)) == (2, "")
    for stops in (("日",), ("y",), (" 日y", "日y"), ("z",)):
        _check_stops(tok, [0, 1, 2, 3], stops)
    import random

    rand = random.Random(0)
    pool = [b"a", b" ", b"\xe6", b"\x97", b"\xa5", b"\xf0\x9f", b"\x8e\x89", b"\xc3", b"\xa9b", b"\xff", b"ab "]
    tok = _ByteTokenizer(pool)
    for _ in range(30):
        tokens = [rand.randrange(len(pool)) for _ in range(rand.randrange(1, 40))]
        full = tok.decode(tokens)
        text, shown = _stream(tok, tokens, rand.randrange(1, 6))
        assert text.text == full == shown
        start = rand.randrange(len(full))
        _check_stops(tok, tokens, (full[start:start + rand.randrange(1, 4)].strip("\ufffd") or "a",))


def test_stops_with_a_trained_byte_level_tokenizer():
    """The same with the tokenizers library's own BPE and decoder: trained on CJK text, it merges a space with
    the first bytes of 日 (token "ĠæĹ"), as large byte-level vocabularies do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(["x 日本 語 ok 日本語 — é"] * 50,
                            trainers.BpeTrainer(vocab_size=262, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe)
    tokens = tok.encode("x 日本 語 ok x 日本語 — é", add_special_tokens=False)
    assert any(tok.decode([t]).rstrip("\ufffd") and tok.decode([t]).endswith("\ufffd") for t in tokens)
    assert _stream(tok, tokens, 1)[0].text == tok.decode(tokens)
    for stops in (("x ",), ("日本",), (" 語", "ok x"), ("— é",), ("q",)):
        _check_stops(tok, tokens, stops)


def test_out_of_range_seed_and_bad_stop_ids_are_argparse_errors(capsys):
    for argv, match in ((["--seed", str(2**31)], "expected an integer in 0..2147483647"),
                        (["--seed", "-1"], "expected an integer in 0..2147483647"),
                        (["--seed", "x"], "expected an integer, got 'x'"),
                        (["--stop-ids", "1,a"], "expected comma-separated integers")):
        with pytest.raises(SystemExit) as e:
            cli.main(["generate", "x", *argv])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert match in err and "--seed" in err or "--stop-ids" in err


def test_invalid_utf8_prompt(capsys, monkeypatch):
    bad = b"caf\xe9".decode("utf-8", "surrogateescape")  # what Python makes of such bytes in argv
    assert "the prompt is not valid UTF-8 (byte 0xe9 at character 3)" in _error(capsys, ["generate", bad])
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xff\xfe")))
    assert "the prompt on stdin is not valid UTF-8 (byte 0xff" in _error(capsys, ["generate", "-"])


@pytest.mark.parametrize("command, content, match", [
    ("generate", '{"prompt": "a"}\n[1]\n', "line 2 is a JSON list, not an object"),
    ("generate", '{"prompt": 3}\n', 'line 1 has no "prompt" string'),
    ("generate", '{"prompt": "a"}\n\n{"turns": []}\n', 'line 3 has no "prompt" string'),  # the file's line
    ("generate", b'{"prompt": "\xff"}\n', "line 1 is not valid UTF-8"),
    ("generate", "\n", "no prompts in the file"),
    ("bench", '{"turns": ["a"]}\n{"turns": [\n', "line 2 is not valid JSON"),
    ("bench", '{"prompt": "a"}\n{"turns": []}\n', 'line 2 has no "prompt" string'),  # generate's reader
])
def test_bad_prompts_file(tmp_path, capsys, command, content, match):
    """generate's and bench's --prompts files: one message naming the file and the line or object."""
    path = tmp_path / "p.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    extra = ["--workload", "mbpp", "--out", str(tmp_path / "o"), "--quiet"] if command == "bench" else []
    err = _error(capsys, [command, "--prompts", str(path), *extra])
    assert match in err and f"--prompts {path}" in err


def test_prompts_naming_a_directory_or_nothing(tmp_path, capsys):
    assert f"--prompts {tmp_path}: is a directory" in _error(capsys, ["generate", "--prompts", str(tmp_path)])
    assert "does not exist" in _error(capsys, ["generate", "--prompts", str(tmp_path / "none.jsonl")])


def test_outputs_are_checked_before_any_work(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    blocked = str(tmp_path / "file" / "sub")
    err = _error(capsys, ["train", "tokenizer", "--out", blocked])
    assert f"--out {blocked}: not writable" in err
    tok = str(tmp_path / "tok")  # beside the outputs: an output never lies in an input
    err = _error(capsys, ["train", "target", "--tokenizer", tok, "--out", str(tmp_path / "o"), "--ckpt-dir", blocked])
    assert f"--ckpt-dir {blocked}: not writable" in err
    err = _error(capsys, ["train", "target", "--tokenizer", tok, "--out", str(tmp_path / "o"),
                          "--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", "0"])
    assert "--ckpt-every 0 with --ckpt-dir would never save a checkpoint" in err


def test_help_shows_defaults_and_version(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    out = capsys.readouterr().out
    assert "(default: 128)" in out and "(default: auto)" in out and "bfloat16 on GPU" in out
    with pytest.raises(SystemExit):
        cli.main(["train", "target", "--help"])
    assert "(default: 120)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert capsys.readouterr().out.startswith("dflash-jax ")



def test_every_option_of_every_subcommand_has_help():
    import argparse

    def commands(parser, prefix=""):  # (full name, parser) of every command, a group's members included
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        for name, p in sub.choices.items():
            if any(isinstance(a, argparse._SubParsersAction) for a in p._actions):
                yield from commands(p, f"{prefix}{name} ")
            else:
                yield prefix + name, p

    found = dict(commands(cli.build_parser()))
    missing = {name: [a.dest for a in p._actions if not a.help] for name, p in found.items()}
    assert {"generate", "ship", "train drafter", "report gpu-check", "report kernel-bench"} <= set(found)
    assert not {name: dests for name, dests in missing.items() if dests}

def test_no_import_cycle_between_cli_and_bench():
    import ast
    import inspect

    from dflash_jax.perf import bench

    tree = ast.parse(inspect.getsource(bench))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom | ast.Import) for a in n.names} | {
        n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(name.startswith("dflash_jax.cli") for name in imported if name) and "cli" not in imported


@shipped
def test_nonfinite_logits_are_an_error_not_a_stop(capsys, tmp_path):
    """An LM head of finite float32 weights (3e37) whose logits overflow to inf: exit 1 with one message, never a
    normal 'stop'. (A temperature whose 1/T overflows is refused before decoding: exit 2.)"""
    import dataclasses
    import shutil

    import numpy as np

    from dflash_jax.io import checkpoint
    from dflash_jax.models.layers import hf_tensors
    from dflash_jax.models.target import init_target
    from dflash_jax.train import lm

    cfg = dataclasses.replace(lm.small_config(vocab_size=512, eos_id=0, hidden=32, layers=4, intermediate=64, heads=2,
                                              kv_heads=1, head_dim=16, linear_key_heads=1, linear_value_heads=2,
                                              linear_head_dim=16, mtp_layers=0), tie_word_embeddings=False)
    tensors = dict(hf_tensors(cfg, init_target(cfg, seed=0).params))
    signs = np.random.default_rng(0).choice([-1.0, 1.0], tensors["lm_head.weight"].shape)
    tensors["lm_head.weight"] = (3e37 * signs).astype(np.float32)  # finite weights; their dot products are not
    model = tmp_path / "overflow"
    model.mkdir()
    checkpoint.write_safetensors(model / "model.safetensors", tensors)
    (model / "config.json").write_text(json.dumps(lm.hf_config(cfg)))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(ASSETS / "target" / name, model / name)
    argv = ["generate", "def f(", "--model", str(model), "--max-new-tokens", "4", "--no-compare", "--quiet", "--json",
            "--ignore-eos"]
    assert cli.main(argv) == 1
    out = capsys.readouterr()
    assert json.loads(out.out)["completions"][0]["finish_reason"] == "nonfinite"
    assert out.err.startswith("dflash-jax: error: prompt 1: the target's logits became non-finite")
    assert "temperature 1e-38 is too small" in _error(capsys, ["generate", "x", "--temperature", "1e-38"])


def test_a_speculative_config_without_a_method_is_a_draft_models_as_in_vllm(capsys):
    spec = cli_generate.parse_speculative_config('{"model": "D", "num_speculative_tokens": 3}')
    assert spec == {"method": "dflash", "model": "D", "num_speculative_tokens": 3}
    err = _error(capsys, ["generate", "x", "--speculative-config", '{"num_speculative_tokens": 3}'])
    assert 'give "method": "mtp"' in err and "unknown method None" not in err
    assert 'give "method": "mtp"' in _error(capsys, ["generate", "x", "--speculative-config", '{"method": null}'])


@pytest.mark.parametrize("argv, match", [
    (["--context", "-5"], "argument --context: expected an integer >= 1, got -5"),
    (["--block", "0"], "argument --block: expected an integer >= 1, got 0"),
    (["--tau", "20"], "--tau must be in [1, --block 16]"),
    (["--tau", "nan"], "--tau must be in [1, --block 16]"),
])
def test_perf_model_flags_are_refused_by_name_before_compiling(capsys, argv, match):
    try:
        err = _error(capsys, ["report", "perf-model", *argv])
    except SystemExit as e:  # refused by argparse while parsing
        assert e.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
    assert match in err and "Traceback" not in err, err


@pytest.mark.parametrize("command", ["generate", "bench", "serve"])
@pytest.mark.parametrize("flag", ["--tensor-parallel-size", "-tp", "--data-parallel-size", "-dp",
                                  "--expert-parallel-size", "--num-processes"])
def test_mesh_sizes_below_one_are_refused_when_parsed(capsys, command, flag):
    with pytest.raises(SystemExit) as e:
        cli.main([command, flag, "0"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "expected an integer >= 1, got 0" in err and flag.lstrip("-")[:2] in err


@shipped
@pytest.mark.parametrize("argv, where", [
    (["--method", "ddtree:100000"], "--method: ddtree:100000"),
    (["--method", "DDTREE:100000"], "--method: ddtree:100000"),  # names in any case
    (["--speculative-config", '{"method": "ddtree", "model": "%s", "num_speculative_tokens": 100000}'
      % (ASSETS / "drafter")], "--speculative-config: ddtree:100000"),
])
def test_a_tree_too_big_for_memory_is_refused_up_front_in_one_line(capsys, argv, where):
    """ddtree:100000 ran 17-47 s, then a 1 TB allocation failed: refused before loading, naming the bound."""
    err = _error(capsys, ["generate", "x", *argv, "--no-compare"])
    assert err.startswith(f"dflash-jax: error: {where}: a draft tree of 100,000 nodes") and "at most ddtree:" in err
    assert err.count("\n") == 1


@shipped
def test_speculative_config_errors_name_the_flag_the_user_gave(tmp_path, capsys):
    for model, why in (("/nonexistent", "no such directory"), (str(ASSETS / "drafter" / "config.json"), "is a file")):
        config = json.dumps({"method": "dflash", "model": model})
        err = _error(capsys, ["generate", "x", "--speculative-config", config, "--no-compare"])
        assert f'--speculative-config "model" {model}: {why}' in err and "--draft-model" not in err
    err = _error(capsys, ["generate", "x", "--method", "ddtree", "--no-compare"])
    assert "cannot parse 'ddtree'" in err and "ddtree:N" in err


@shipped
def test_bench_blames_every_bad_method_at_once(tmp_path, capsys):
    err = _error(capsys, ["bench", "--methods", "dflash2:8,dflash2:32", "--draft-model", str(ASSETS / "drafter"),
                          "--num-prompts", "1", "--out", str(tmp_path / "o"), "--quiet"])
    assert "dflash2:32: larger than the drafter's block size 16" in err
    assert "dflash2:8, dflash2:32: the drafter" in err and "is a DFlash drafter, not a DFlash2 one" in err
    err = _error(capsys, ["bench", "--methods", "dflash2:1,ddtree:0", "--out", str(tmp_path / "o"), "--quiet"])
    assert "'dflash2:1'" in err and "'ddtree:0'" in err


@shipped
def test_bench_gives_each_method_its_own_shipped_drafter(tmp_path, capsys, monkeypatch):
    """``bench --methods ar,dflash:16,dflash2:16`` (no --draft-model): dflash:16 drafts with the shipped DFlash
    drafter, dflash2:16 with the shipped DFlash2 one, in one run."""
    from dflash_jax.cli import bench as cli_bench

    seen = {}

    class Stop(Exception):
        pass

    def capture(workload, prompts, methods, target, drafters, *args, **kwargs):
        seen.update(workload=workload, drafters={m.name: d.cfg.dflash2 for m, d in drafters.items()})
        raise Stop

    monkeypatch.setattr(cli_bench, "bench_workload", capture)
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text('{"prompt": "def f(x):"}\n')
    with pytest.raises(Stop):
        cli.main(["bench", "--methods", "ar,dflash:16,dflash2:16", "--prompts", str(prompts), "--out",
                  str(tmp_path / "o"), "--quiet"])
    assert seen == {"workload": "mine.jsonl", "drafters": {"dflash:16": False, "dflash2:16": True}}


@shipped
@pytest.mark.parametrize("command", ["generate", "bench"])
def test_generate_and_bench_keep_their_programs_in_the_compilation_cache(tmp_path, monkeypatch, command):
    """``--compilation-cache-dir`` (serve's flag, ``compile_cache``: its own tests show programs kept and loaded) on
    generate and bench, enabled with the folder given before anything compiles."""
    from dflash_jax.io import compile_cache

    class Enabled(Exception):
        pass

    def enable(path=None):
        raise Enabled(path)

    monkeypatch.setattr(compile_cache, "enable", enable)
    argv = ["x", "--no-compare"] if command == "generate" else ["--out", str(tmp_path / "o"), "--quiet"]
    with pytest.raises(Enabled) as got:
        cli.main([command, *argv, "--compilation-cache-dir", str(tmp_path / "cache")])
    assert got.value.args == (str(tmp_path / "cache"),)
