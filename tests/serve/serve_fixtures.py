"""Helpers of the serving tests: a server on 127.0.0.1 and a free port, run in this process (its engine and
counters in reach) by the same ``build`` and uvicorn settings (``cli.serve.server``) that ``dflash-jax serve``
runs, stopped by the test itself."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time

from dflash_jax.cli import build_parser
from dflash_jax.cli import serve as cli_serve

START_TIMEOUT_S = 60  # after build (models loaded): uvicorn binding its socket
STOP_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Running:
    base_url: str
    served: object  # serve.app.Served
    server: object  # uvicorn.Server
    app: object  # the Starlette app

    @property
    def engine(self):
        return self.served.engine


@contextlib.contextmanager
def running(*flags: str):
    """A server of ``dflash-jax serve FLAGS`` on 127.0.0.1 (a free port), in a thread; stopped (draining) on exit."""
    port = free_port()
    args = build_parser().parse_args(["serve", *flags, "--host", "127.0.0.1", "--port", str(port)])
    served, app = cli_serve.build(args)
    args.uvicorn_log_level = "warning"
    server = cli_serve.server(app, args)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start on 127.0.0.1:{port}")
        time.sleep(0.05)
    try:
        yield Running(f"http://127.0.0.1:{port}", served, server, app)
    finally:
        server.should_exit = True
        thread.join(STOP_TIMEOUT_S)
        assert not thread.is_alive(), "the server did not stop"
