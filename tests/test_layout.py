"""The package's shape, read from its imports: one-way layers, no cycles, no measurement code on the API path.

Every ``dflash_jax`` module's imports are read from its source (``ast``, top-level and function-level alike,
``TYPE_CHECKING`` blocks included), so a cycle hidden behind a lazy import counts too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dflash_jax"

# Each layer may import only the layers before it (and itself); kernels is a leaf library anyone may use.
# ``frontend`` (model folders, tokenizer, methods) sits above decoding/ and below everything that faces a user;
LAYERS = ("config", "io", "parallel", "models", "decoding", "frontend", "train", "perf", "serve",
          "cli")
CORE = ("config", "io", "parallel", "models", "decoding")


def _module_name(path: Path) -> str:
    parts = ["dflash_jax", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py") if "assets" not in p.parts}


def _imports(path: Path, known: set[str]) -> set[str]:
    """The dflash_jax modules ``path`` imports (``from pkg import module`` resolves to the module)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                     for a in node.names]
        else:
            continue
        out.update(n for n in names if n.split(".")[0] == "dflash_jax" and n in known)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(p, set(mods)) - {m} for m, p in mods.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "api"


def test_no_import_cycle():
    graph, state, cycles = _graph(), {}, []

    def visit(m, stack):
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                cycles.append(" -> ".join([*stack[stack.index(n):], n]))
            elif n not in state:
                visit(n, [*stack, n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_layers_point_one_way():
    """config <- io <- parallel <- models <- decoding <- frontend <- train/perf/serve <- cli; kernels imports
    nothing."""
    bad = []
    for m, deps in _graph().items():
        layer = _layer(m)
        for d in deps:
            dl = _layer(d)
            if layer == "kernels":
                if dl != "kernels":
                    bad.append(f"{m} imports {d}: dflash_jax/kernels/ imports nothing from the rest of the package")
            elif dl in ("kernels", "api") or layer == "api":
                continue
            elif LAYERS.index(dl) > LAYERS.index(layer):
                bad.append(f"{m} ({layer}) imports {d} ({dl})")
    assert not bad, "\n".join(sorted(bad))


def test_argparse_lives_in_cli():
    users = [m for m, p in _modules().items() if _layer(m) != "cli"
             and any(isinstance(n, ast.Import | ast.ImportFrom) and "argparse" in
                     ([a.name for a in n.names] if isinstance(n, ast.Import) else [n.module or ""])
                     for n in ast.walk(ast.parse(p.read_text())))]
    assert not users, f"argparse outside dflash_jax/cli: {users}"


def test_top_level_is_small():
    top = sorted(p.name for p in PACKAGE.iterdir()
                 if p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))
    assert len(top) <= 12, top


def test_public_api_loads_no_measurement_module():
    code = ("import sys, dflash_jax\n"
            "from dflash_jax import load_target, load_drafter, generate, stream, make_generate, SpecConfig, "
            "SamplingConfig\n"
            "print('\\n'.join(m for m in sys.modules if m.startswith('dflash_jax.')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    outside = [m for m in loaded if _layer(m) not in (*CORE, "kernels")]
    assert not outside, f"import dflash_jax loads {outside}"
