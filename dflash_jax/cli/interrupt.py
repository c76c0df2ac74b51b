"""Ctrl-C and SIGTERM for the command line: a stop that nothing in the process can swallow.

Used by ``args.run`` around every subcommand, its parsing (the imports) included. Python raises
``KeyboardInterrupt`` wherever the main thread happens to be when its signal handler runs, and where that is a
garbage-collector callback (JAX registers one, ``_xla_gc_callback``) or a ``__del__``, the exception is printed as
"Exception ignored in ..." and dropped: the command runs on to its end. And while the main thread sits in native
code (an XLA compile), no Python handler runs at all. ``stop_on_signals`` therefore

- handles SIGINT and SIGTERM alike (SIGTERM used to kill the process outright, leaving a claimed output folder
  holding only its marker): ``KeyboardInterrupt`` in the main thread, so ``run`` undoes its claims and exits with
  128 + the signal (130, 143);
- never raises inside a GC callback or ``__del__``, where it would be dropped, and has a watcher thread (woken by
  the signal itself, ``signal.set_wakeup_fd``, whatever the main thread is doing) deliver the signal to the main
  thread again every ``REDELIVER`` seconds until ``run`` has taken it;
- ends the process itself after ``FORCE_AFTER`` seconds if the main thread never took it (stuck in native code):
  the ``cleanup`` given (the command's claims undone), one line, ``os._exit(128 + signal)``.

A command that installs its own handlers later (``serve``: uvicorn's graceful shutdown) owns those signals: the
watcher stands aside while the handler installed is not this one. A signal the parent left ignored (a script's
background job: SIGINT) stays ignored.
"""

from __future__ import annotations

import _thread
import contextlib
import gc
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)
REDELIVER = 0.5  # seconds between deliveries to a main thread that has not taken the signal yet
FORCE_AFTER = 5.0  # seconds after the first signal at which the process ends itself


def _swallowed_here(frame) -> bool:
    """Whether an exception raised in ``frame`` would be dropped: a GC callback or a ``__del__`` is on the stack."""
    callbacks = {getattr(cb, "__code__", None) for cb in gc.callbacks}
    while frame is not None:
        if frame.f_code in callbacks or frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


class Stop:
    """The state of one command's signals: the first stop signal received, and whether the main thread took it."""

    def __init__(self, cleanup: Callable[[], None]):
        self.signum: int | None = None
        self.taken = threading.Event()  # the main thread is handling the stop: no more deliveries
        self._cleanup = cleanup
        self._done = threading.Event()

    @property
    def status(self) -> int:
        """The exit status of a stopped command: 128 + the signal (SIGINT: 130)."""
        return 128 + (self.signum or signal.SIGINT)

    def take(self) -> int:
        """Called by the main thread as it handles the stop; its exit status."""
        self.taken.set()
        return self.status

    def handler(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
        if self.taken.is_set() or _swallowed_here(frame):
            return  # already stopping, or the exception would be dropped: the watcher delivers it again
        raise KeyboardInterrupt

    def _ours(self, signum: int) -> bool:
        return signal.getsignal(signum) == self.handler

    def watch(self, read_fd: int) -> None:
        """The watcher thread: waits for a stop signal that this handler owns (the wakeup fd's byte), then
        delivers it to the main thread until taken, and ends the process if it never is."""
        signum = None
        while signum is None:
            data = os.read(read_fd, 64)
            if self._done.is_set() or not data:
                return
            signum = next((b for b in data if b in SIGNALS and self._ours(b)), None)
        if self.signum is None:
            self.signum = signum
        waited = 0.0
        while waited < FORCE_AFTER:
            if self._done.wait(REDELIVER):
                return
            waited += REDELIVER
            if not self.taken.is_set() and self._ours(signum):
                _thread.interrupt_main(self.signum)
        if not self._ours(signum):
            return
        if not self.taken.is_set():
            with contextlib.suppress(Exception):
                self._cleanup()
        print(f"\ndflash-jax: interrupted (signal {self.signum}); stopped after {FORCE_AFTER:.0f} s", file=sys.stderr,
              flush=True)
        os._exit(self.status)

    def close(self) -> None:
        self._done.set()


@contextlib.contextmanager
def stop_on_signals(cleanup: Callable[[], None]) -> Iterator[Stop]:
    """SIGINT and SIGTERM handled as the module says for the block (then the previous handlers are back).
    Outside the main thread (signals cannot be handled there) the block runs with nothing changed."""
    stop = Stop(cleanup)
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    # a signal the parent set to be ignored (a background job of a script: SIGINT) stays ignored
    previous = {s: signal.signal(s, stop.handler) for s in SIGNALS if signal.getsignal(s) != signal.SIG_IGN}
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    watcher = threading.Thread(target=stop.watch, args=(read_fd,), name="dflash-jax-signals", daemon=True)
    watcher.start()
    try:
        yield stop
    finally:
        signal.set_wakeup_fd(previous_fd)
        for s, h in previous.items():
            signal.signal(s, h)
        stop.close()
        with contextlib.suppress(OSError):
            os.write(write_fd, b"\0")  # wakes the watcher's read
        watcher.join()
        os.close(read_fd)
        os.close(write_fd)
