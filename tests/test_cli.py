"""The ``dflash-jax`` command line as a user meets it: the main job on the shipped models, and its errors."""

from __future__ import annotations

import pytest

from dflash_jax import cli

ASSETS = cli.ASSETS
shipped = pytest.mark.skipif(not (ASSETS / "target" / "config.json").is_file(), reason="shipped models absent")


@shipped
def test_generate_streams_and_summarises_on_the_shipped_models(capsys):
    assert cli.main(["generate", "def fibonacci(n):", "--max-new-tokens", "16", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("def fibonacci(n):")
    summary = out.strip().splitlines()[-1]
    assert "tau" in summary and "tok/s" in summary and "speed-up" in summary and "WARNING" not in summary


@shipped
def test_generate_with_vllm_speculative_config_and_no_compare(capsys):
    config = '{"method": "dflash", "model": "%s", "num_speculative_tokens": 3}' % (ASSETS / "drafter")
    assert cli.main(["generate", "import os", "--speculative-config", config, "--max-new-tokens", "8",
                     "--no-compare", "--quiet"]) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert "block 4" in summary and "speed-up" not in summary


def test_errors_name_the_problem(tmp_path, capsys):
    assert cli.main(["generate", "x", "--model", str(tmp_path / "nowhere"), "--quiet"]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert cli.main(["generate", "x", "--speculative-config", '{"method": "eagle"}', "--quiet"]) == 2
    assert "unknown method 'eagle'" in capsys.readouterr().err
    assert cli.main(["generate", "x", "--speculative-config", "{not json", "--quiet"]) == 2
    assert "not valid JSON" in capsys.readouterr().err


@shipped
def test_a_target_directory_is_not_a_drafter(capsys):
    assert cli.main(["generate", "x", "--draft-model", str(ASSETS / "target"), "--quiet"]) == 2
    assert "not a DFlash drafter config" in capsys.readouterr().err
