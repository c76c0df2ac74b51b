"""The GPU check (``dflash-jax gpu-check``): its --smoke mode runs every part end to end at tiny shapes (so it
cannot rot), and ``python -m dflash_jax.cli.gpu_check`` is the same one command."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import pytest

from dflash_jax import cli
from dflash_jax.perf import gpu_check


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU refusal")
def test_refuses_a_cpu_without_smoke(tmp_path, capsys):
    assert cli.main(["gpu-check", "--out", str(tmp_path)]) == 2
    assert "needs a GPU" in capsys.readouterr().err


def test_unknown_part_is_named(tmp_path, capsys):
    assert cli.main(["gpu-check", "--smoke", "--out", str(tmp_path), "--parts", "kernels,bogus"]) == 2
    assert "--parts: unknown ['bogus']" in capsys.readouterr().err


def test_module_command_collects_the_kernel_tests(tmp_path):
    """The tests part finds the kernel test files from the checkout's root and pytest collects every one."""
    proc = subprocess.run([sys.executable, "-m", "dflash_jax.cli.gpu_check", "--smoke", "--out", str(tmp_path),
                           "--parts", "tests"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RuntimeWarning" not in proc.stderr
    tests = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]["tests"]
    assert tests["met"] and "collected" in tests["summary"], tests
    assert all(str(gpu_check.REPO / "tests" / f) in tests["command"] for f in gpu_check.KERNEL_TESTS)
    assert json.loads(proc.stdout)["parts"]["tests"] == tests


@pytest.mark.slow
def test_smoke_runs_every_part(tmp_path):
    assert cli.main(["gpu-check", "--smoke", "--out", str(tmp_path), "--parts", "kernels,steps,e2e"]) == 0
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    parts = result["parts"]
    assert result["smoke"] and set(parts) == {"kernels", "steps", "e2e"}
    assert all("error" not in p for p in parts.values()), parts
    assert parts["kernels"]["max_rel_error"] < 1e-4  # the interpreted kernel equals its reference
    assert parts["steps"]["decode_ms"] > 0 and parts["steps"]["verify_ms"] > 0
    e2e = parts["e2e"]
    assert e2e["same_tokens"] and e2e["tau"] > 5  # 9 drafts accepted per step, the last step cut by max_new
