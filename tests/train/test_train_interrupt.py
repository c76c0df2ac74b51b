"""Ctrl-C and SIGTERM stop a ``train ...`` command within seconds (issue 41, 1.3), in a real process.

A KeyboardInterrupt raised inside a garbage-collector callback (JAX registers one) is printed as "Exception ignored"
and dropped, so Ctrl-C used to be lost and training ran to its end; SIGTERM killed the process outright and left
the claimed output folder holding only its marker. Here the child's own GC callback holds the main thread when
SIGINT arrives (deterministically: it tells the test it is inside, then sleeps), and a second child gets SIGTERM
once its output folder is claimed. Both must exit with 128 + the signal within seconds, leaving no output or
checkpoint folder behind (nothing was trained yet)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dflash_jax.io import atomic

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "dflash_jax" / "assets" / "target"
# argv: marker file whose existence arms the GC callback, file it creates when inside, then the CLI's arguments
CHILD = """
import gc, os, sys, time
marker, inside = sys.argv[1], sys.argv[2]
def hold(phase, info):  # the first collection after the output folder is claimed holds the main thread 2 s
    if inside and phase == "start" and os.path.exists(marker):
        open(inside, "w").close()
        globals()["inside"] = ""
        time.sleep(2)
gc.callbacks.append(hold)
from dflash_jax import cli
sys.exit(cli.main(sys.argv[3:]))
"""


def _start(tmp_path: Path, name: str, hold: bool) -> tuple[subprocess.Popen, Path, Path, Path]:
    out, ckpt, inside = tmp_path / f"{name}_out", tmp_path / f"{name}_ckpt", tmp_path / f"{name}_inside"
    args = ["train", "target", "--tokenizer", str(TOKENIZER), "--out", str(out), "--ckpt-dir", str(ckpt),
            "--layers", "4", "--hidden", "32", "--intermediate", "64", "--seq", "32", "--batch", "2",
            "--steps", "100000"]
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(out / atomic.MARKER), str(inside) if hold else "",
                             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    return proc, out, ckpt, inside


def _wait_for(path: Path, proc: subprocess.Popen, limit: float = 120.0) -> None:
    t0 = time.monotonic()
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() - t0 < limit, f"{path} did not appear in {limit} s"
        time.sleep(0.05)


def _stopped(proc: subprocess.Popen, sig: int, limit: float = 12.0) -> tuple[int, str, float]:
    t0 = time.monotonic()
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"signal {sig} did not stop the command within {limit} s:\n{err[-2000:]}") from None
    return proc.returncode, err, time.monotonic() - t0


def test_ctrl_c_and_sigterm_stop_training_within_seconds_and_leave_no_marker_folder(tmp_path):
    held, held_out, held_ckpt, inside = _start(tmp_path, "int", hold=True)
    term, term_out, term_ckpt, _ = _start(tmp_path, "term", hold=False)
    try:
        _wait_for(inside, held)  # the main thread is now inside the GC callback
        status, err, seconds = _stopped(held, signal.SIGINT)
        assert status == 130, err[-2000:]
        assert "Exception ignored" not in err and "dflash-jax: interrupted" in err
        _wait_for(term_out / atomic.MARKER, term)
        time.sleep(0.5)
        status, err, _ = _stopped(term, signal.SIGTERM)
        assert status == 143, err[-2000:]
    finally:
        for proc in (held, term):
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for folder in (held_out, held_ckpt, term_out, term_ckpt):
        assert not folder.exists(), sorted(p.name for p in folder.iterdir())
