"""The command line as users meet it: the verbs in order, ``train`` and ``report`` groups, the old flat names
with a notice, and a ``--help`` that loads neither JAX nor transformers."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dflash_jax import cli


def test_help_lists_the_verbs_then_the_groups_in_order_one_line_each(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    lines = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("    ")]
    assert [words[0] for words in lines] == ["generate", "serve", "bench", "compile", "quantize", "train", "ship",
                                             "report"]
    assert all(len(words) > 1 for words in lines)  # the help on the name's own line
    with pytest.raises(SystemExit):
        cli.main(["report", "--help"])
    lines = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("    ")]
    assert [words[0] for words in lines] == list(cli.GROUPS["report"]) and all(len(w) > 1 for w in lines)
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("    ")] == [
        "tokenizer", "target", "drafter", "mtp"]


def test_building_the_parser_for_help_imports_no_jax_and_no_command_module():
    code = ("import sys; from dflash_jax.cli import build_parser; build_parser(['--help']); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'transformers', 'flax') "
            "or m.startswith(('dflash_jax.cli.generate', 'dflash_jax.perf', 'dflash_jax.decoding.api'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("old, new", [("train-drafter", "train drafter"), ("perf-model", "report perf-model"),
                                      ("quant-report", "report quant"), ("kernel-report", "report kernels"),
                                      ("serve-bench", "report serve-bench")])
def test_old_names_still_run_with_a_one_line_notice(capsys, old, new):
    with pytest.raises(SystemExit):
        cli.main([old, "--help"])
    out = capsys.readouterr()
    assert out.err == (f"dflash-jax: note: `dflash-jax {old}` is now `dflash-jax {new}`; the old name goes in the "
                       f"next release\n")
    assert out.out.startswith(f"usage: dflash-jax {new} ")


def test_a_command_is_known_by_its_full_name():
    args = cli.build_parser(["report", "quant"]).parse_args(["report", "quant"])
    assert args.command == "report quant"
    assert cli.module_command("dflash_jax.cli.quant_report") == ["report", "quant"]
    assert cli.module_command("dflash_jax.cli.generate") == ["generate"]
