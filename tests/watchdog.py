"""A watchdog for tests of inputs that used to hang: the block fails (``Hang``) once it runs past a limit.

SIGALRM interrupts Python code and C code that checks for signals (``re``, ``regex``, sleeps); ``Hang`` is a
BaseException so that no ``except Exception`` in the code under test swallows it. Main thread only.
"""

from __future__ import annotations

import contextlib
import signal


class Hang(BaseException):
    """The watched block ran past its limit."""


@contextlib.contextmanager
def watchdog(seconds: float):
    def fire(*_):
        raise Hang(f"still running after {seconds} s: a hang")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
