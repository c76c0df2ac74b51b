"""``dflash-jax serve`` as a command: its flags (and a port in use) refused before any weight loads, the model id's
default, the compilation cache folder it is given, uvicorn's colours only on a terminal, an engine that fails
ending it with status 1 (``/health`` failing first), and, as a process of its own, SIGTERM: it stops taking
connections, finishes the requests in flight, and exits, having logged its speculation by load; a second start
of the same configuration compiles nothing. (The block's wiring in a default run:
``test_app.py``'s server.)"""

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import httpx
import pytest
from serve_fixtures import free_port

from dflash_jax import frontend
from dflash_jax.cli import build_parser, main
from dflash_jax.cli import serve as cli_serve
from dflash_jax.decoding.sampling import SamplingConfig
from dflash_jax.io import compile_cache
from dflash_jax.serve.engine import Job

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
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be >= 1"),
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
                             "--max-num-seqs", "2", "--no-warmup"],  # the block: auto, by load
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
        assert "speculation by load: each step runs 1 or 16 over the running rows' bucket of 1/2" in text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


@pytest.mark.parametrize("flags, want", [(["--compilation-cache-dir", "/tmp/x-cache"], "/tmp/x-cache"),
                                         ([], None)])  # None: compile_cache.default_dir() (tests: a temp folder)
def test_the_compilation_cache_folder_is_enabled_before_anything_loads(flags, want, monkeypatch):
    asked = []

    def build(*a, **k):
        raise ValueError("stopped here")

    monkeypatch.setattr(compile_cache, "enable", lambda path: asked.append(path))
    monkeypatch.setattr(cli_serve, "build", build)
    assert main(["serve", "--port", "0", "--max-model-len", "64", *flags]) == 2
    assert asked == [want]


class _Stream:
    def __init__(self, tty: bool):
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("stderr_tty, colours", [(False, False), (True, True)])
def test_uvicorn_colours_its_log_only_on_a_terminal(stderr_tty, colours, monkeypatch):
    """stdout a terminal, stderr (uvicorn's log) a file: no ANSI codes (uvicorn alone looked at stdout only)."""
    from starlette.applications import Starlette

    from dflash_jax.serve import server as serve_server

    monkeypatch.setattr(serve_server, "sys", types.SimpleNamespace(stdout=_Stream(True), stderr=_Stream(stderr_tty)))
    server = cli_serve.server(Starlette(), build_parser().parse_args(["serve"]))
    assert server.config.use_colors is colours
    (handler,) = logging.getLogger("uvicorn").handlers
    line = handler.formatter.format(logging.LogRecord("uvicorn.error", logging.INFO, __file__, 1, "ready", None, None))
    assert ("\x1b[" in line) is colours, line


def test_a_fatal_engine_error_fails_health_and_ends_serve_with_status_1(monkeypatch, caplog):
    """(Was: every request answered 503 "shutting down" for minutes while /health said 200 and the process lived
    on.) The engine's thread fails on a prompt no prefill takes: the request in flight is answered "abort", the
    server fails /health and stops, and the command returns 1."""
    built = {}
    build = cli_serve.build

    def keep(*a, **k):
        built["served"], app = build(*a, **k)
        return built["served"], app

    monkeypatch.setattr(cli_serve, "build", keep)
    port = free_port()
    base, status, reply = f"http://127.0.0.1:{port}", {}, {}
    flags = ["--port", str(port), "--max-model-len", "32", "--max-num-seqs", "2", "--block-size", "1", "--no-warmup",
             "--compilation-cache-dir", ""]
    thread = threading.Thread(target=lambda: status.update(rc=main(["serve", *flags])))
    thread.start()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        engine = built["served"].engine
        body = {"prompt": "def f(x):\n", "max_tokens": 20, "ignore_eos": True}
        asking = threading.Thread(target=lambda: reply.update(r=httpx.post(base + "/v1/completions", json=body,
                                                                            timeout=TIMEOUT_S)))
        asking.start()
        while not (engine.stats()["active"] or engine.stats()["waiting"]):
            assert asking.is_alive() and time.monotonic() < deadline
            time.sleep(0.01)
        engine.submit(Job(prompt=[None], max_tokens=1, sampling=SamplingConfig(), seed=0, stop_ids=(),
                          emit=lambda tokens, finish: None))
        asking.join(TIMEOUT_S)
        assert reply["r"].status_code == 200 and reply["r"].json()["choices"][0]["finish_reason"] == "abort"
        deadline = time.monotonic() + TIMEOUT_S
        while True:  # /health fails from now until the server has stopped listening
            try:
                r = httpx.get(base + "/health", timeout=5)
            except httpx.TransportError:
                break
            if r.status_code != 200:
                assert r.status_code == 503 and "the engine failed" in r.json()["error"]["message"]
                break
            assert time.monotonic() < deadline, "/health still says 200"
        thread.join(TIMEOUT_S)
        assert not thread.is_alive() and status["rc"] == 1
        assert "the engine failed: /health answers 503 and the server stops" in caplog.text
    finally:
        if thread.is_alive():
            built["served"].engine.close(drain=False)


@pytest.mark.slow
def test_a_second_start_compiles_nothing_the_first_compiled(tmp_path):
    """Two starts of one configuration (a small one, warmed up) with one --compilation-cache-dir: the second's
    ready line counts 0 programs compiled, and loads what the first compiled; it times no step, and logs the
    step costs the first measured (kept beside the programs: ``serve/cost_cache.py``)."""
    counts, tables = [], []
    for run in range(2):
        port = free_port()
        log = open(tmp_path / f"serve{run}.log", "w+")
        proc = subprocess.Popen([sys.executable, "-m", "dflash_jax.cli.serve", "--port", str(port), "--max-model-len",
                                 "64", "--max-num-seqs", "2", "--block-size", "4", "--compilation-cache-dir",
                                 str(tmp_path / "cache")], stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not (found := re.search(r"ready in [\d.]+ s \((\d+) programs compiled, (\d+) loaded from",
                                          (tmp_path / f"serve{run}.log").read_text())):
                assert proc.poll() is None, (tmp_path / f"serve{run}.log").read_text()
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.5)
            counts.append((int(found[1]), int(found[2])))
            text = (tmp_path / f"serve{run}.log").read_text()
            tables.append((re.search(r"included:\n(.*?)\nE\[tokens", text, re.S)[1], "warm-up: timing" in text))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(TIMEOUT_S)
            log.close()
    (first_compiled, first_loaded), (second_compiled, second_loaded) = counts
    assert first_compiled > 0 and second_compiled == 0 and second_loaded == first_compiled + first_loaded, counts
    assert tables[0][1] and not tables[1][1] and tables[1][0] == tables[0][0], tables


@pytest.mark.parametrize("flags, want", [
    ([], 2**30),  # 1G
    (["--no-enable-prefix-caching"], 0),
    (["--prefix-cache-size", "512M"], 512 * 2**20),
    (["--prefix-cache-size", "123456"], 123456),
    (["--prefix-cache-size", "0.25"], os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4),  # a CPU: RAM
])
def test_the_prefix_cache_size(flags, want):
    args = build_parser().parse_args(["serve", *flags])
    assert abs(cli_serve._prefix_cache_bytes(args) - want) <= 1


def test_a_bad_prefix_cache_size_names_its_forms(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--prefix-cache-size", "1.5"])
    assert "expected bytes (e.g. 512M, 2G, 1073741824) or a fraction of the memory in (0, 1)" in capsys.readouterr().err


def test_a_long_start_up_phase_is_logged_again_while_it_lasts(monkeypatch, caplog):
    monkeypatch.setattr(cli_serve, "HEARTBEAT_S", 0.05)
    caplog.set_level(logging.INFO, "dflash_jax.serve")
    with cli_serve._Phases() as say:
        say("warm-up: program 3 of 9: a step")
        time.sleep(0.5)
    lines = [r.getMessage() for r in caplog.records]
    time.sleep(0.2)
    assert lines[0] == "warm-up: program 3 of 9: a step" and len(lines) >= 3
    assert all(re.fullmatch(r"warm-up: program 3 of 9: a step \(still at it: \d+ s\)", n) for n in lines[1:]), lines
    assert len(caplog.records) == len(lines)  # nothing once the start is over
