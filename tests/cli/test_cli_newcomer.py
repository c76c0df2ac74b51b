"""``dflash-jax generate`` as a new user first tries it (issue 25): --model DIR alone decodes (plainly, or with
the checkpoint's MTP head, saying which), hub ids get a clear message or are found in the Hugging Face cache,
--dtype auto / float16, a file as --model, prompts from a FIFO or with a BOM, warnings before the stream, broken
tokenizers and templates as messages, every flag documented, Ctrl-C exits 130."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from dflash_jax import cli, frontend
from dflash_jax.decoding import workloads
from dflash_jax.models.target import init_target
from dflash_jax.train import lm

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _error(capsys, argv) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("dflash-jax: error: ") and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny target without an MTP head, with the shipped tokenizer, max_position_embeddings 64."""
    path = tmp_path_factory.mktemp("tiny") / "model"
    path.mkdir()
    cfg = lm.small_config(vocab_size=512, eos_id=0, hidden=32, layers=4, intermediate=64, heads=2, kv_heads=1,
                          head_dim=16, linear_key_heads=1, linear_value_heads=2, linear_head_dim=16, mtp_layers=0)
    import dataclasses

    lm.save_target(path, init_target(dataclasses.replace(cfg, max_position_embeddings=64), seed=1))
    for name in TOKENIZER_FILES:
        shutil.copy(frontend.ASSETS / "target" / name, path / name)
    return path


def _run(capsys, argv):
    assert cli.main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr()
    return json.loads(out.out) if "--json" in argv else out.out, out.err


FAST = ["--max-new-tokens", "4", "--no-compare", "--chat-template", "off", "--ignore-eos"]


def test_model_without_a_drafter_decodes_plainly_and_says_so(tiny, capsys):
    doc, err = _run(capsys, ["generate", "def f(x):", "--model", str(tiny), *FAST, "--json"])
    assert doc["method"] == "ar" and len(doc["completions"][0]["tokens"]) == 4
    assert "no drafter given: plain decoding" in err


def test_model_with_an_mtp_head_drafts_with_it(capsys):
    from dflash_jax.frontend import ASSETS

    doc, err = _run(capsys, ["generate", "def f(x):", "--model", str(ASSETS / "target"), *FAST, "--json"])
    assert doc["method"] == "mtp:3" and "has an MTP head, so it drafts (mtp:3)" in err


def test_hub_ids_are_explained_or_found_in_the_cache(tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    err = _error(capsys, ["generate", "x", "--model", "Qwen/Qwen3.5-27B"])
    assert "--model Qwen/Qwen3.5-27B: no such directory, and hub ids are not downloaded" in err
    assert "huggingface-cli download Qwen/Qwen3.5-27B" in err and str(tmp_path / "hf" / "hub") in err
    repo = tmp_path / "hf" / "hub" / "models--me--tiny"
    shutil.copytree(tiny, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    assert frontend.model_dir("me/tiny", "--model") == repo / "snapshots" / "abc123"
    doc, _ = _run(capsys, ["generate", "x", "--model", "me/tiny", *FAST, "--json", "--quiet"])
    assert doc["model"] == str(repo / "snapshots" / "abc123")


def test_a_file_as_model_and_dtype_choices(tiny, capsys):
    err = _error(capsys, ["generate", "x", "--model", str(tiny / "config.json")])
    assert f"--model {tiny / 'config.json'}: is a file; give the checkpoint directory that holds config.json ({tiny})" \
        in err
    err = _error(capsys, ["generate", "x", "--model", str(tiny), "--dtype", "float16"])
    assert "--dtype float16 is not supported: Qwen3.5's activations exceed float16's range" in err
    assert frontend.resolve_dtype("auto", tiny) == "float32"  # the checkpoint's torch_dtype
    doc, _ = _run(capsys, ["generate", "x", "--model", str(tiny), "--dtype", "auto", *FAST, "--json", "--quiet"])
    assert doc["dtype"] == "float32"


def test_prompts_from_a_fifo_and_with_a_bom(tmp_path):
    fifo = tmp_path / "prompts"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\n{"prompt": "b"}\n'))
    writer.start()
    assert workloads.read_prompt_texts(str(fifo), "--prompts") == ["a", "b"]
    writer.join(timeout=10)


def test_position_warning_uses_real_lengths_and_comes_before_the_stream(tiny, capsys, monkeypatch):
    """The tiny target has max_position_embeddings 64: a 20-token prompt (bucket 32) + 40 tokens fits (no
    warning, though bucket + 40 would not); + 50 tokens does not, and the warning is on stderr before the first
    streamed token."""
    from dflash_jax.cli import generate as gen_cli

    prompt = "x " * 10
    assert 16 < len(frontend.encode(frontend.load_tokenizer(tiny), prompt, "off")) <= 24  # bucket 32
    _, err = _run(capsys, ["generate", prompt, "--model", str(tiny), *FAST[2:], "--max-new-tokens", "40", "--quiet"])
    assert "max_position_embeddings" not in err
    seen = []
    real = gen_cli.stream

    def stream(*a, **k):
        seen.append(capsys.readouterr())  # what was printed before the first token
        return real(*a, **k)

    monkeypatch.setattr(gen_cli, "stream", stream)
    _, err = _run(capsys, ["generate", "x " * 15, "--model", str(tiny), *FAST[2:], "--max-new-tokens", "50",
                           "--quiet"])
    assert "dflash-jax: warning: prompt 1: the longest prompt (" in seen[0].err
    assert "exceeds the target's max_position_embeddings 64" in seen[0].err and "warning" not in seen[0].out


def test_broken_tokenizer_and_chat_template_are_messages(tiny, tmp_path, capsys):
    broken = tmp_path / "tok"
    shutil.copytree(tiny, broken)
    (broken / "tokenizer.json").write_text((tiny / "tokenizer.json").read_text()[:500])
    err = _error(capsys, ["generate", "x", "--model", str(tiny), "--tokenizer", str(broken), "--no-compare",
                          "--quiet"])
    assert f"--tokenizer {broken}: no usable tokenizer" in err
    shutil.copy(tiny / "tokenizer.json", broken / "tokenizer.json")
    config = json.loads((broken / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ raise_exception('no system prompts here') }}"
    (broken / "tokenizer_config.json").write_text(json.dumps(config))
    err = _error(capsys, ["generate", "x", "--model", str(tiny), "--tokenizer", str(broken), "--no-compare",
                          "--quiet"])
    assert "the tokenizer's chat template failed" in err and "no system prompts here" in err
    assert "--chat-template off" in err


def test_invalid_exclude_regex_is_a_message(tiny, tmp_path, capsys):
    err = _error(capsys, ["quantize", "--model", str(tiny), "--out", str(tmp_path / "q"), "--exclude", "re:(x"])
    assert "exclude pattern 're:(x' is not a valid regular expression" in err


def _options(parser):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from ((f"{name} {o}", h) for o, h in _options(sub))
        elif action.option_strings and action.dest != "help":
            yield "/".join(action.option_strings), action.help


@pytest.mark.parametrize("command", ["generate", "bench", "quantize", "train tokenizer", "train target",
                                     "train drafter", "train mtp"])
def test_every_flag_has_help_text(command):
    parser = cli.build_parser()
    missing = [o for o, h in _options(parser) if o.rsplit(" ", 1)[0] == command
               and (not h or h.startswith("(default") or h == "==SUPPRESS==")]
    assert missing == []


def test_ctrl_c_while_the_command_is_imported_exits_130_without_a_traceback():
    """Ctrl-C in the seconds ``main`` spends importing the command's module (JAX, transformers), before the
    command's own signal handling is installed: the same one line and status as later."""
    main = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "from dflash_jax.cli import main; print('importing', file=sys.stderr, flush=True); "
            "sys.exit(main(sys.argv[1:]))")
    proc = subprocess.Popen([sys.executable, "-c", main, "generate", "def f(x):"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    first = proc.stderr.readline()
    time.sleep(0.3)  # inside ``main`` by then, and still importing: the command's module takes seconds
    proc.send_signal(signal.SIGINT)
    _, rest = proc.communicate(timeout=60)
    err = first + rest
    assert first == "importing\n" and proc.returncode == 130, err
    assert "dflash-jax: interrupted" in err and "Traceback" not in err


@pytest.mark.slow
def test_ctrl_c_exits_130_without_a_traceback(tiny):
    # Ctrl-C as a terminal's foreground process gets it: Python maps SIGINT to KeyboardInterrupt only where the
    # parent left it at its default, and a test worker's earlier tests may leave it ignored (inherited across exec).
    main = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "from dflash_jax.cli import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.Popen([sys.executable, "-c", main, "generate", "def f(x):", "--model", str(tiny),
                             "--no-compare", "--ignore-eos", "--max-new-tokens", "20000"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if "compiling" in line:
            break
    proc.send_signal(signal.SIGINT)  # while it compiles or decodes: 20000 tokens outlast a busy machine's delay
    _, rest = proc.communicate(timeout=120)
    err = "".join(lines) + rest
    assert proc.returncode == 130, err
    assert "dflash-jax: interrupted" in err and "Traceback" not in err
