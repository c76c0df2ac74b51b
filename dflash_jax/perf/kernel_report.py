"""Compile report: register, spill, LDS and MFMA figures of every shipped kernel config for an AMD arch.

Where it sits: a developer tool beside the kernels (``dflash-jax report kernels --arch gfx950``)
and a library for tests/perf/test_kernel_report.py; nothing in the model imports it. It needs no GPU.

How it works, per ``KernelCase`` from each kernel module's ``report_cases()``:
1. Lower the case for ``rocm`` on the CPU (``jax.jit(fn).trace(*args).lower(lowering_platforms=("rocm",))``).
2. Find each ``stablehlo.custom_call @__gpu$xla.gpu.triton``. With jaxlib <= 0.10.2 Pallas stores the
   Triton IR (TTIR) there as raw, uncompressed MLIR *bytecode* in the ``ir`` string of the
   ``mhlo.backend_config`` dictionary, next to ``name``, ``num_warps``, ``num_stages`` and ``grid_*``.
3. Re-parse that bytecode with jaxlib's own MLIR bindings (its Triton dialect registered) and print it
   as text: jaxlib's bytecode comes from a newer MLIR than the PyPI ``triton`` wheels are built
   against, while the textual form parses in both.
4. Compile the text with the ``triton`` package's AMD backend for ``GPUTarget("hip", arch, 64)``
   (``pip install -e .[triton]``) and read the AMDGCN assembly: the ``.amdgpu_metadata`` block gives
   VGPR / AGPR / SGPR counts, spill counts and scratch bytes, the kernel metadata the LDS bytes, and
   the ``v_mfma`` lines the static MFMA instruction count.

The figures approximate what XLA builds on device: XLA compiles the same TTIR with the Triton bundled
in jaxlib, whose version and pass pipeline may differ slightly from the PyPI wheel.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import tempfile
from pathlib import Path

import jax

from dflash_jax.kernels.common import KernelCase

KERNEL_MODULES = ("attention", "gdn", "moe", "mxfp4")
TRITON_CALL = "__gpu$xla.gpu.triton"
LDS_LIMIT = {"gfx950": 160 * 1024, "gfx942": 64 * 1024, "gfx90a": 64 * 1024}


@dataclasses.dataclass(frozen=True)
class TritonKernel:
    """One ``pallas_call`` as XLA receives it: TTIR text and launch parameters."""

    name: str
    ttir: str
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]


@dataclasses.dataclass
class KernelStats:
    """Compile figures of one Triton kernel of one case (``error`` set and figures 0 if it failed)."""

    case: str
    kernel: str
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]
    vgpr: int = 0
    agpr: int = 0
    sgpr: int = 0
    vgpr_spill: int = 0
    sgpr_spill: int = 0
    scratch_bytes: int = 0
    lds_bytes: int = 0
    mfma: int = 0
    error: str = ""


@dataclasses.dataclass
class Report:
    arch: str
    triton_version: str | None
    rows: list[KernelStats]
    notes: list[str]


def collect_cases(modules=KERNEL_MODULES) -> tuple[list[KernelCase], list[str]]:
    """``report_cases()`` of each kernel module; modules or functions not written yet become notes."""
    cases, notes = [], []
    for mod_name in modules:
        full = f"dflash_jax.kernels.{mod_name}"
        try:
            mod = importlib.import_module(full)
        except ModuleNotFoundError as e:
            if e.name != full:  # the module exists but one of its imports failed: say so
                raise
            notes.append(f"{full}: no such module yet, skipped")
            continue
        fn = getattr(mod, "report_cases", None)
        if fn is None:
            notes.append(f"{full}: no report_cases() yet, skipped")
            continue
        cases.extend(fn())
    return cases, notes


def _triton_calls(op, found):
    from jax._src.lib.mlir import ir

    for region in op.regions:
        for block in region:
            for child in block:
                child = child.operation
                if (child.name == "stablehlo.custom_call"
                        and ir.StringAttr(child.attributes["call_target_name"]).value == TRITON_CALL):
                    found.append(child)
                _triton_calls(child, found)
    return found


def extract_kernels(case: KernelCase, platform: str = "rocm") -> list[TritonKernel]:
    """Lowers ``case.fn`` for ``platform`` and returns its Triton kernels with TTIR as text."""
    from jax._src.lib.mlir import ir
    from jaxlib.triton import dialect

    lowered = jax.jit(case.fn).trace(*case.args).lower(lowering_platforms=(platform,))
    kernels = []
    for call in _triton_calls(lowered.compiler_ir("stablehlo").operation, []):
        config = ir.DictAttr(call.attributes["mhlo.backend_config"])
        bytecode = ir.StringAttr(config["ir"]).value_bytes
        with ir.Context() as ctx, ir.Location.unknown():
            dialect.register_dialect(ctx)
            ttir = ir.Module.parse(bytecode).operation.get_asm()
        kernels.append(TritonKernel(
            name=ir.StringAttr(config["name"]).value,
            ttir=ttir,
            num_warps=ir.IntegerAttr(config["num_warps"]).value,
            num_stages=ir.IntegerAttr(config["num_stages"]).value,
            grid=tuple(ir.IntegerAttr(config[f"grid_{a}"]).value for a in "xyz"),
        ))
    return kernels


def _metadata_int(asm: str, key: str) -> int:
    m = re.search(rf"^\s*\.{key}:\s+(\d+)", asm, re.MULTILINE)
    return int(m.group(1)) if m else 0


def compile_kernel(kernel: TritonKernel, arch: str = "gfx950", case: str = "") -> KernelStats:
    """Compiles one kernel's TTIR for ``arch`` with the triton package and reads the AMDGCN figures."""
    import triton
    from triton.backends.compiler import GPUTarget

    stats = KernelStats(case=case, kernel=kernel.name, num_warps=kernel.num_warps,
                        num_stages=kernel.num_stages, grid=kernel.grid)
    with tempfile.TemporaryDirectory() as tmp:
        # triton.compile takes IR sources by path; the suffix selects the TTIR stage.
        path = Path(tmp) / f"{kernel.name}.ttir"
        path.write_text(kernel.ttir)
        try:
            options = {"num_warps": kernel.num_warps, "num_stages": kernel.num_stages}
            compiled = triton.compile(str(path), target=GPUTarget("hip", arch, 64), options=options)
        except Exception as e:  # a backend failure is a finding to report, not a crash
            stats.error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            return stats
    asm = compiled.asm["amdgcn"]
    meta = asm[asm.index(".amdgpu_metadata"):]
    stats.vgpr = _metadata_int(meta, "vgpr_count")
    stats.agpr = _metadata_int(meta, "agpr_count")
    stats.sgpr = _metadata_int(meta, "sgpr_count")
    stats.vgpr_spill = _metadata_int(meta, "vgpr_spill_count")
    stats.sgpr_spill = _metadata_int(meta, "sgpr_spill_count")
    stats.scratch_bytes = _metadata_int(meta, "private_segment_fixed_size")
    # Triton allocates its shared memory dynamically (metadata.shared) on top of any static LDS.
    stats.lds_bytes = compiled.metadata.shared + _metadata_int(meta, "group_segment_fixed_size")
    stats.mfma = len(re.findall(r"^\s*v_mfma", asm, re.MULTILINE))
    return stats


def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def run_report(arch: str = "gfx950", modules=KERNEL_MODULES, cases: list[KernelCase] | None = None,
               name_filter: str = "", dump_ir: str | None = None) -> Report:
    """Lowers every case, extracts its Triton kernels and, with triton installed, compiles them for ``arch``.

    Without triton the rows carry only the launch parameters and ``error`` says why.
    """
    notes = []
    if cases is None:
        cases, notes = collect_cases(modules)
    cases = [c for c in cases if name_filter in c.name]
    version = triton_version()
    if version is None:
        notes.append("triton is not installed (pip install -e .[triton]): lowered and extracted TTIR only")
    rows = []
    for case in cases:
        for kernel in extract_kernels(case):
            if dump_ir:
                out = Path(dump_ir) / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', case.name)}.{kernel.name}.ttir"
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(kernel.ttir)
            if version is None:
                rows.append(KernelStats(case.name, kernel.name, kernel.num_warps, kernel.num_stages,
                                        kernel.grid, error="not compiled (no triton)"))
            else:
                rows.append(compile_kernel(kernel, arch, case.name))
    return Report(arch=arch, triton_version=version, rows=rows, notes=notes)


def problems(row: KernelStats, lds_limit: int | None) -> list[str]:
    """What is wrong with one compiled kernel: a failure, register spills, LDS over the CU's budget."""
    out = [row.error] if row.error else []
    if row.vgpr_spill or row.sgpr_spill:
        out.append(f"spills: {row.vgpr_spill} VGPR, {row.sgpr_spill} SGPR")
    if lds_limit is not None and row.lds_bytes > lds_limit:
        out.append(f"LDS {row.lds_bytes} > {lds_limit} bytes")
    return out


def format_table(report: Report) -> str:
    cols = ("case", "kernel", "warps", "stages", "grid", "vgpr", "agpr", "sgpr", "vspill", "sspill",
            "scratch", "lds", "mfma", "error")
    lines = [cols]
    for r in report.rows:
        figures = (r.vgpr, r.agpr, r.sgpr, r.vgpr_spill, r.sgpr_spill, r.scratch_bytes, r.lds_bytes, r.mfma)
        cells = [r.case, r.kernel, r.num_warps, r.num_stages, "x".join(map(str, r.grid))]
        cells += ["-"] * len(figures) if r.error else list(figures)
        lines.append(tuple(str(c) for c in cells) + (r.error,))
    widths = [max(len(line[i]) for line in lines) for i in range(len(cols))]
    # names left-aligned, numbers right-aligned, the error column free-form
    fmt = lambda cells: "  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                                  for i, (c, w) in enumerate(zip(cells[:-1], widths, strict=False))) + \
        ("  " + cells[-1] if cells[-1] else "")
    head = f"{report.arch} (triton {report.triton_version or 'not installed'})"
    rule = tuple("-" * w for w in widths[:-1]) + ("",)
    return "\n".join([head, fmt(lines[0]), fmt(rule)] + [fmt(line) for line in lines[1:]]
                     + [f"note: {n}" for n in report.notes])
