"""Ctrl-C and SIGTERM stop a ``train ...`` command within seconds (issue 41, 1.3), in a real process.

A KeyboardInterrupt raised inside a garbage-collector callback (JAX registers one) is printed as "Exception ignored"
and dropped, so Ctrl-C used to be lost and training ran to its end; SIGTERM killed the process outright and left
the claimed output folder holding only its marker. Here the child's own GC callback holds the main thread when
SIGINT arrives (deterministically: it tells the test it is inside, then sleeps), and a second child gets SIGTERM
once its output folder is claimed. Both must exit with 128 + the signal within seconds, leaving no output or
checkpoint folder behind (nothing was trained yet).

The children start with the signal dispositions of a terminal's foreground process. Inherited from the test runner
they need not be: a runner started as a script's background job (``nohup pytest &``) ignores SIGINT, its xdist
workers and their children too, and a command rightly keeps a signal its parent ignored (the last test here), so
SIGINT stopped nothing (two whole-suite runs failed that way: killed after the limit, no line on stderr)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_jax.cli import interrupt
from dflash_jax.io import atomic

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "dflash_jax" / "assets" / "target"
HOLD = 2.0  # seconds the GC callback holds the main thread
# at most the hold, then the forced exit of a main thread that never takes the signal, plus a loaded machine's delays
LIMIT = HOLD + interrupt.FORCE_AFTER + 5.0
# argv: marker file whose existence arms the GC callback, file it creates when inside, then the CLI's arguments
CHILD = f"""
import gc, os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # a foreground process's, whatever the runner's
signal.signal(signal.SIGTERM, signal.SIG_DFL)
marker, inside = sys.argv[1], sys.argv[2]
def hold(phase, info):  # the first collection after the output folder is claimed holds the main thread
    if inside and phase == "start" and os.path.exists(marker):
        open(inside, "w").close()
        globals()["inside"] = ""
        time.sleep({HOLD})
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


def _stopped(proc: subprocess.Popen, sig: int) -> tuple[int, str]:
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=LIMIT)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"signal {sig} did not stop the command within {LIMIT} s:\n{err[-2000:]}") from None
    return proc.returncode, err


def test_ctrl_c_and_sigterm_stop_training_within_seconds_and_leave_no_marker_folder(tmp_path):
    held, held_out, held_ckpt, inside = _start(tmp_path, "int", hold=True)
    term, term_out, term_ckpt, _ = _start(tmp_path, "term", hold=False)
    try:
        _wait_for(inside, held)  # the main thread is now inside the GC callback
        status, err = _stopped(held, signal.SIGINT)
        assert status == 130, err[-2000:]
        assert "Exception ignored" not in err and "dflash-jax: interrupted" in err
        _wait_for(term_out / atomic.MARKER, term)
        time.sleep(0.5)
        status, err = _stopped(term, signal.SIGTERM)
        assert status == 143, err[-2000:]
    finally:
        for proc in (held, term):
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for folder in (held_out, held_ckpt, term_out, term_ckpt):
        assert not folder.exists(), sorted(p.name for p in folder.iterdir())


def test_a_signal_the_parent_ignored_stays_ignored():
    """A script's background job ignores SIGINT (the terminal's Ctrl-C is not for it): so does the command."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with interrupt.stop_on_signals(lambda: None):
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(interrupt.REDELIVER * 2)  # a watcher that had taken it would have delivered it by now
    except KeyboardInterrupt:
        pytest.fail("SIGINT, ignored by the parent, interrupted the command")
    finally:
        signal.signal(signal.SIGINT, previous)
