"""The suite without torch: torch-free tests still run, tests that need the transformers oracle skip.

A subprocess runs pytest with torch hidden from the import system (as on a machine without it), over
one torch-free module and one that needs the oracle.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Hides torch from the path finder: `import torch` raises ModuleNotFoundError, find_spec("torch") is
# None and no torch distribution is listed, so transformers also sees no torch.
HIDE_TORCH = '''
import sys
from importlib.machinery import PathFinder


class NoTorch:
    @staticmethod
    def find_spec(name, path=None, target=None):
        return None if name.split(".")[0] == "torch" else PathFinder.find_spec(name, path, target)

    @staticmethod
    def find_distributions(*args, **kwargs):
        return (d for d in PathFinder.find_distributions(*args, **kwargs) if d.metadata["Name"] != "torch")

    @staticmethod
    def invalidate_caches():
        PathFinder.invalidate_caches()


sys.meta_path[:] = [NoTorch if f is PathFinder else f for f in sys.meta_path]
'''


def test_torch_free_tests_run_and_oracle_tests_skip_without_torch(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(HIDE_TORCH)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    probe = subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True, text=True)
    assert "No module named 'torch'" in probe.stderr  # the hiding works
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist",  # one process
         "tests/kernels/test_moe.py", "-k", "bad_shapes", "tests/models/test_target.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert " passed" in out and "error" not in out.lower(), out
    assert "SKIPPED" in out and "needs torch" in out, out
