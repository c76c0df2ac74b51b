"""``dflash-jax serve`` as a command: its flags (and a port in use) refused before any weight loads, its defaults
(the model id, the block chosen by cost and logged), and, as a process of its own, SIGTERM: it stops taking
connections, finishes the requests in flight, and exits."""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from serve_fixtures import free_port, running

from dflash_jax.cli import build_parser, main
from dflash_jax.cli import serve as cli_serve
from dflash_jax.decoding import blocksize, runtime
from dflash_jax.perf import step_cost

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

    monkeypatch.setattr(runtime, "load_models", load)
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


def test_the_block_is_chosen_by_cost_for_the_slots_and_logged(monkeypatch, caplog):
    """Without --block-size, serve asks ``step_cost.choose`` (generate's --block-size auto) for --max-num-seqs
    rows, serves the block it chose, and logs the reason. The choice itself is proved in the block-size tests;
    here it is stood in for, so that this runs in seconds (the slow SIGTERM test runs the real one)."""
    asked = {}

    def choose(target, drafter, prompts, *, batch, **kw):
        asked.update(batch=batch, prompts=prompts, **kw)
        costs = {1: 1.0, 4: 1.5, 16: 9.0}
        return blocksize.choose_block([0.9, 0.8, 0.7] + [0.1] * 12, costs, batch=batch, source="stood in"), None

    monkeypatch.setattr(step_cost, "choose", choose)
    with caplog.at_level(logging.INFO, logger="dflash_jax.serve"):
        with running("--max-num-seqs", "3", "--max-model-len", "64", "--no-warmup") as r:
            assert r.engine.loop.spec.block_size == 4 and r.served.speculative
            assert httpx.get(r.base_url + "/stats").json()["block_size"] == 4
            out = httpx.post(r.base_url + "/v1/completions", json={"prompt": "def f(x):\n", "max_tokens": 3,
                                                                   "ignore_eos": True}, timeout=300)
            assert out.json()["usage"]["completion_tokens"] == 3
    assert asked["batch"] == 3 and asked["max_new_tokens"] <= 64 - max(map(len, asked["prompts"]))
    assert "block size auto: 4 (3 speculative tokens) at batch 3" in caplog.text


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
        # uvicorn re-raises the signal once its graceful shutdown is done: the status says what ended it
        assert proc.wait(TIMEOUT_S) in (0, -signal.SIGTERM)
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
