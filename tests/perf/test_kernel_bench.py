"""``dflash-jax report kernel-bench`` (perf/kernel_bench.py) times kernels on a GPU only: a CPU is refused with a
pointer to the compile report, which needs none."""

from __future__ import annotations

import jax
import pytest

from dflash_jax import cli


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU refusal")
def test_refuses_a_cpu(capsys):
    assert cli.main(["report", "kernel-bench", "--filter", "27b"]) == 2
    err = capsys.readouterr().err
    assert "needs a GPU" in err and "dflash-jax report kernels" in err
