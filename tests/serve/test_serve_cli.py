"""``dflash-jax serve`` as a command: its flags (and a port in use) refused before any weight loads, the model id's
default, and, as a process of its own, SIGTERM: it stops taking connections, finishes the requests in flight,
and exits, having chosen its block by cost (measured) and logged it. (The block's wiring in a default run:
``test_app.py``'s server.)"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from serve_fixtures import free_port

from dflash_jax import frontend
from dflash_jax.cli import build_parser, main
from dflash_jax.cli import serve as cli_serve

START_TIMEOUT_S = 600  # import, load and first compiles on a busy 2-core machine
TIMEOUT_S = 300


@pytest.mark.parametrize("flags, needle", [
    (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
    (["--max-model-len", "100000"], "exceeds the target's max_position_embeddings"),
    (["--speculative-config", '{"method": "eagle"}'], "unknown method 'eagle'"),
    (["--speculative-config", "{"], "--speculative-config is not valid JSON"),
    (["--block-size", "99"], "exceed the drafter's block size"),
    (["--port", "70000"], "--port must be in 0..65535"),
    (["--num-processes", "2"], "serve runs in one process"),
])
def test_bad_flags_are_refused_before_loading(flags, needle, capsys):
    assert main(["serve", *flags]) == 2
    assert needle in capsys.readouterr().err


def test_a_port_in_use_is_refused_before_the_models_load(monkeypatch, capsys):
    def load(*a, **k):
        raise AssertionError("the models loaded")

    monkeypatch.setattr(frontend, "load_models", load)
    with socket.socket() as other:  # another server on the port
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        assert main(["serve", "--port", str(port), "--max-model-len", "64"]) == 2
    err = capsys.readouterr().err
    assert f"--port {port}: cannot listen on 127.0.0.1:{port}" in err and "another --port" in err


@pytest.mark.parametrize("flags, name", [
    ([], cli_serve.SHIPPED_NAME),
    (["--model", "./my-target"], "./my-target"),  # as given, not made absolute
    (["--model", "./my-target", "--served-model-name", "m"], "m"),
])
def test_the_model_id_is_the_name_as_given(flags, name):
    assert cli_serve.model_name(build_parser().parse_args(["serve", *flags])) == name


@pytest.mark.slow
def test_sigterm_finishes_in_flight_requests_and_exits(tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "dflash_jax.cli.serve", "--port", str(port), "--max-model-len", "64",
                             "--max-num-seqs", "2", "--no-warmup"],  # the block: auto, measured
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"the server exited: {(tmp_path / 'serve.log').read_text()}"
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        started, results = [threading.Event(), threading.Event()], [None, None]

        def stream(i):
            body = {"prompt": f"def f{i}(x):\n", "max_tokens": 40, "temperature": 0, "stream": True, "ignore_eos": True}
            events = []
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=TIMEOUT_S) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        started[i].set()
            results[i] = events

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for e in started:
            assert e.wait(TIMEOUT_S), "a stream never started"
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(TIMEOUT_S)
        # uvicorn re-raises the signal once its graceful shutdown is done: the status says what ended it (128 + the
        # signal from ``cli.interrupt``'s handler, which uvicorn's gives back)
        assert proc.wait(TIMEOUT_S) in (0, -signal.SIGTERM, 128 + signal.SIGTERM)
        for events in results:  # each in-flight request ran to its end
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
            assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
        with pytest.raises(httpx.TransportError):
            httpx.get(base + "/health", timeout=5)
        log.seek(0)
        text = log.read()
        assert "no chat template" in text  # chat requests are encoded as generate --chat-template auto does
        assert "block size auto: " in text and " at batch 2, the most expected tokens/s" in text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
