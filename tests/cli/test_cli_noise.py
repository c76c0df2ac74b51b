"""What a newcomer should not see on a CPU host (issue 33, section 6): libtpu's ``E0000 ... unexpected worker
hostname`` block when ``compile`` loads it for a named TPU topology, and transformers' "PyTorch was not found" notice
under README's "no torch needed". Each in a fresh subprocess, as a user's process meets it."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent


def _python(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("TPU_")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd="/",
                          env={**base, **(env or {})})


TOPOLOGY = """
import os
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"  # other processes (the rest of the suite) may hold libtpu's lock
os.environ["TPU_SKIP_MDS_QUERY"] = "1"
{before}
from jax.experimental import topologies
print(len(topologies.get_topology_desc("v5p:2x2x1", platform="tpu").devices))
"""


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
def test_libtpu_starts_silently_on_a_host_without_tpus():
    from jax._src import hardware_utils

    if hardware_utils.num_available_tpu_chips_and_device_id()[0]:
        pytest.skip("this host has TPU chips: libtpu finds its workers itself")
    bare = _python(TOPOLOGY.format(before=""))
    if bare.returncode:
        pytest.skip(f"libtpu cannot start here: {bare.stderr.strip().splitlines()[-1]}")
    assert "unexpected worker hostname" in bare.stderr  # the noise, as a user without the CLI's setting gets it
    quiet = _python(TOPOLOGY.format(before="from dflash_jax.cli import args\nargs.quiet_libtpu()"))
    assert quiet.returncode == 0 and quiet.stdout.strip() == "4", quiet.stderr
    assert quiet.stderr.strip() == "", quiet.stderr
    # a worker list someone set is theirs: left alone
    theirs = _python("from dflash_jax.cli import args; import os; args.quiet_libtpu(); "
                     "print(os.environ['TPU_WORKER_HOSTNAMES'])", env={"TPU_WORKER_HOSTNAMES": "10.0.0.1,10.0.0.2"})
    assert theirs.stdout.strip() == "10.0.0.1,10.0.0.2"


def test_readme_tokenizer_needs_no_torch_and_says_nothing_about_it():
    """README's "From Python" example up to its tokenizer, with torch hidden from the import system: no notice."""
    from test_readme import _example
    from test_without_torch import HIDE_TORCH

    example = _example()
    head = example[:example.index("prompts = ")]
    run = _python(HIDE_TORCH + "\n" + head + "\nimport sys\nassert 'torch' not in sys.modules\n"
                  "print(tokenizer.decode(tokenizer.encode('def f(x):')))\n")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().endswith("def f(x):")
    assert not re.search(r"PyTorch was not found|torch", run.stderr), run.stderr


def test_compile_says_nothing_of_the_donated_buffers_a_phase_alone_frees():
    """``compile`` compiles the loop's phases one by one, each donating the state ``step`` updates in place; the
    parts a phase alone returns nothing for are freed, and JAX's "Some donated buffers were not usable" said so
    on every run. ``compile_report.compile_program`` (what ``compile`` runs per program) keeps it quiet."""
    import warnings

    import jax
    import jax.numpy as jnp

    from dflash_jax.perf import compile_report

    one = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    phase = jax.jit(lambda x, cache: (x * 2, cache[:2]), donate_argnums=1)  # the cache: no output to alias
    args = [jax.ShapeDtypeStruct(shape, jnp.float32, sharding=one) for shape in ((4,), (8,))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compile_report.compile_program(phase, args)["argument_bytes"] == 48
