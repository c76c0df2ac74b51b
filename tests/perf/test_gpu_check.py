"""The GPU check script: its --smoke mode runs every part end to end at tiny shapes (so it cannot rot)."""

from __future__ import annotations

import json

import jax
import pytest

from dflash_jax.perf import gpu_check


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU refusal")
def test_refuses_a_cpu_without_smoke(tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    assert "needs a GPU" in capsys.readouterr().err


def test_unknown_part_is_named(tmp_path):
    with pytest.raises(SystemExit):
        gpu_check.main(["--smoke", "--out", str(tmp_path), "--parts", "kernels,bogus"])


@pytest.mark.slow
def test_smoke_runs_every_part(tmp_path):
    assert gpu_check.main(["--smoke", "--out", str(tmp_path), "--parts", "kernels,steps,e2e"]) == 0
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    parts = result["parts"]
    assert result["smoke"] and set(parts) == {"kernels", "steps", "e2e"}
    assert all("error" not in p for p in parts.values()), parts
    assert parts["kernels"]["max_rel_error"] < 1e-4  # the interpreted kernel equals its reference
    assert parts["steps"]["decode_ms"] > 0 and parts["steps"]["verify_ms"] > 0
    e2e = parts["e2e"]
    assert e2e["same_tokens"] and e2e["tau"] > 5  # 9 drafts accepted per step, the last step cut by max_new
