"""The HTTP server around the app (``app.py``): uvicorn as ``dflash-jax serve`` runs it and the tests start it.

Bounds on idle clients: uvicorn closes a connection that stays idle after a response (``timeout_keep_alive``,
``--timeout-keep-alive``), but waits forever for a request's headers: for a connection that sends nothing, or
part of its headers. ``_Protocol`` (uvicorn's h11 protocol) closes one whose headers are not whole
``read_timeout`` seconds (``--read-timeout``) after it opened or after its last response; the body's bound is
the app's (a 408). Headers are at most h11's 16 KiB, uvicorn's default. Colours in uvicorn's log only when both
of its streams are terminals (its own check looks at stdout alone, and its main log goes to stderr).
``make`` also tells the app how to stop the server: when the engine fails, the app fails ``/health`` and asks
the server to exit, and ``dflash-jax serve`` then exits with status 1.
"""

from __future__ import annotations

import functools
import sys

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol


class _Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request headers take over ``read_timeout`` seconds."""

    def __init__(self, *args, read_timeout: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.read_timeout, self._timer = read_timeout, None

    def _arm(self) -> None:
        self._disarm()
        self._timer = self.loop.call_later(self.read_timeout, self._expire)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():  # still no whole headers
            self.transport.close()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # a request's headers arrived (or the connection ended)
            self._disarm()

    def on_response_complete(self) -> None:
        self._arm()  # the next request's headers are due from now (a pipelined one disarms it at once)
        super().on_response_complete()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)


def make(app, *, host: str, port: int, log_level: str, timeout_keep_alive: int, read_timeout: float) -> uvicorn.Server:
    """The uvicorn server of ``app`` (``app.create_app``) on ``host``:``port``, closing idle connections after
    ``timeout_keep_alive`` seconds and slow requests after ``read_timeout`` (headers, then the body's own);
    a failed engine stops it."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=None,
                            http=functools.partial(_Protocol, read_timeout=read_timeout), ws="none",
                            timeout_keep_alive=timeout_keep_alive,
                            use_colors=sys.stderr.isatty() and sys.stdout.isatty())
    server = uvicorn.Server(config)
    app.state.read_timeout = read_timeout

    def stop() -> None:
        server.should_exit = True

    app.state.on_engine_failure = stop
    return server
