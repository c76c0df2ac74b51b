"""The gfx950 compile report on the shipped attention configs: TTIR extraction from the lowered
StableHLO, and (with the ``triton`` extra installed) no register spills and LDS within the CU budget."""

import importlib.util

import pytest

from dflash_jax.kernels.attention import report_cases
from dflash_jax.perf import kernel_report as report

GFX950_LDS = 160 * 1024


def test_extracts_ttir_from_rocm_lowering():
    case = report_cases()[0]
    [kernel] = report.extract_kernels(case)
    assert kernel.name == "attention" and "tt.func" in kernel.ttir and "tt.dot" in kernel.ttir
    assert kernel.num_warps in (4, 8) and kernel.num_stages == 1


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed (pip install -e .[triton]); cannot compile for gfx950")
def test_attention_configs_compile_for_gfx950_without_spills():
    result = report.run_report("gfx950", cases=report_cases())
    assert result.rows, "no kernels compiled"
    print("\n" + report.format_table(result))
    bad = {r.case: report.problems(r, GFX950_LDS) for r in result.rows if report.problems(r, GFX950_LDS)}
    assert not bad, bad
    assert all(r.mfma > 0 for r in result.rows)  # the dots became MFMA instructions
