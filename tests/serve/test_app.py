"""The HTTP server on the shipped pair, driven by the official ``openai`` client and by raw HTTP (httpx, sockets):
the OpenAI shapes (whole and streamed, agent turns), the per-request settings, vLLM's neutral fields, and the
faults (bad JSON, unknown fields and roles, numbers of thousands of digits, a prompt over the context, a body over
the cap, a lone surrogate, a full queue, a client that leaves mid-stream, mid-request or mid-body, idle and slow
connections, many clients at once), the counters against what clients were told, and the load generator of
``serve-bench`` against it. One server for the module."""

import json
import logging
import socket
import threading
import time

import httpx
import numpy as np
import openai
import pytest
from serve_fixtures import running

from dflash_jax import frontend
from dflash_jax.cli import main
from dflash_jax.perf import serve_load

MAX_LEN = 128
SLOTS = 2
QUEUE = 2
TIMEOUT_S = 300  # a bound on any one request, far above its need
CHUNK = 32  # --max-num-batched-tokens: prompts prefilled in chunks of up to 32 tokens
READ_TIMEOUT_S = 2  # the server's --read-timeout: a connection without whole headers (or body) this long is closed
PROMPT = "def fibonacci(n):\n"


@pytest.fixture(scope="module")
def server():
    """The module's server: no --block-size, so the engine chooses plain decoding or the drafter's block each step
    (``serve/schedule.py``) from the step costs its warm-up times, here in one rows bucket (``--auto-rows``: each
    bucket is a compiled step per option; the schedule's tests weigh several)."""
    notes = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: notes.append(record.getMessage())
    serve_log = logging.getLogger("dflash_jax.serve")
    level = serve_log.level
    serve_log.addHandler(handler)
    serve_log.setLevel(logging.INFO)
    try:
        with running("--max-num-seqs", str(SLOTS), "--max-model-len", str(MAX_LEN), "--max-queue-len", str(QUEUE),
                     "--served-model-name", "tiny", "--read-timeout", str(READ_TIMEOUT_S), "--auto-rows",
                     str(SLOTS), "--max-num-batched-tokens", str(CHUNK), "--prefix-cache-size", "64M") as r:
            r.notes = notes
            yield r
    finally:
        serve_log.removeHandler(handler)
        serve_log.setLevel(level)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", timeout=TIMEOUT_S, max_retries=0)


def _post(server, path, body, **kw):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.base_url + path, content=content, timeout=TIMEOUT_S,
                      headers={"Content-Type": "application/json"}, **kw)


def _new_records(before, after):
    """The /stats records of the requests that finished between two readings (the list keeps the last ones)."""
    n = after["requests"] - before["requests"]
    assert n <= after["finished_kept"]
    return after["finished"][len(after["finished"]) - n:]


def _wait_idle(server):
    deadline = time.monotonic() + TIMEOUT_S
    while (s := server.engine.stats())["active"] or s["waiting"]:
        assert time.monotonic() < deadline, "the engine never became idle"
        time.sleep(0.05)
    return s


def test_models_and_health(server, client):
    assert httpx.get(server.base_url + "/health").status_code == 200
    (model,) = client.models.list().data
    assert model.id == "tiny"


def test_chat_without_template_is_the_raw_prompt_and_streams_the_same_text(server, client):
    tok = server.served.tokenizer
    assert not tok.chat_template  # the shipped tokenizer: chat is encoded as generate --chat-template auto does
    ids = frontend.encode(tok, PROMPT, "auto")
    kw = dict(model="tiny", max_tokens=24, temperature=0)
    chat = client.chat.completions.create(messages=[{"role": "user", "content": PROMPT}], **kw)
    assert chat.usage.prompt_tokens == len(ids)
    done = client.completions.create(prompt=ids, **kw)  # token ids: the same request without chat
    assert chat.choices[0].message.content == done.choices[0].text
    assert chat.usage.completion_tokens == done.usage.completion_tokens
    assert chat.choices[0].finish_reason in ("stop", "length")
    parts, usage, reasons = [], None, []
    for chunk in client.chat.completions.create(messages=[{"role": "user", "content": PROMPT}], stream=True,
                                                stream_options={"include_usage": True}, **kw):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            reasons.append(chunk.choices[0].finish_reason)
        else:
            usage = chunk.usage
    assert "".join(parts) == chat.choices[0].message.content
    assert reasons[-1] == chat.choices[0].finish_reason and not any(reasons[:-1])
    assert usage.completion_tokens == chat.usage.completion_tokens
    for u in (chat.usage, done.usage, usage):  # OpenAI's field: prompt tokens the engine's prefix cache held
        assert 0 <= u.prompt_tokens_details.cached_tokens < u.prompt_tokens


def test_max_tokens_stop_and_meta_info(server, client):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True, "return_meta_info": True})
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"
    meta = out.model_extra["meta_info"]
    assert meta["completion_tokens"] == 5 and meta["spec_verify_ct"] >= 1
    assert meta["spec_accept_length"] == pytest.approx(5 / meta["spec_verify_ct"])
    longer = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
    stop = longer[10:13]
    cut = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].text == longer[:longer.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_seeded_sampling_reproducible_over_http(server, client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=20, temperature=1.0, top_p=0.9, extra_body={"top_k": 50})
    a = client.completions.create(seed=11, **kw).choices[0].text
    assert client.completions.create(seed=11, **kw).choices[0].text == a


@pytest.mark.parametrize("body, status, needle", [
    (b'{"prompt": "x", ', 400, "not valid JSON"),
    (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, "nested too deeply"),
    ({"prompt": "x", "max_tokens": 2, "frobnicate": 1}, 400, "unknown field 'frobnicate'"),
    ({"prompt": "x", "max_tokens": 0}, 400, "'max_tokens' must be an integer >= 1"),
    ({"prompt": "x", "temperature": -1}, 400, "'temperature' must be a number >= 0"),
    ({"prompt": "x", "seed": "s"}, 400, "'seed' must be an integer"),
    ({"prompt": "x", "model": "other"}, 404, "'other' does not exist"),
    ({"prompt": "x" * 4 * MAX_LEN}, 400, f"maximum context length is {MAX_LEN} tokens"),
    ({"prompt": "x", "max_tokens": MAX_LEN}, 400, f"maximum context length is {MAX_LEN} tokens"),
])
def test_bad_requests_name_the_field(server, body, status, needle):
    r = _post(server, "/v1/completions", body)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]


def test_chat_fields_checked(server):
    r = _post(server, "/v1/chat/completions", {"messages": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_client_leaving_mid_stream_frees_its_slot(server):
    before = server.engine.stats()["requests"]
    body = {"prompt": PROMPT, "max_tokens": MAX_LEN - 20, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=TIMEOUT_S) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # the stream started
    stats = _wait_idle(server)
    assert stats["requests"] == before + 1
    tokens, _, reason = stats["finished"][-1]
    assert reason == "abort" and tokens < MAX_LEN - 20


def test_full_queue_is_503_with_retry_after_and_the_rest_complete(server):
    n = SLOTS + QUEUE + 4
    results = [None] * n
    body = {"prompt": PROMPT, "max_tokens": 60, "temperature": 0, "ignore_eos": True}

    def ask(i):
        results[i] = _post(server, "/v1/completions", body)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    busy = [r for r in results if r.status_code == 503]
    ok = [r for r in results if r.status_code == 200]
    assert len(busy) + len(ok) == n and busy and len(ok) >= SLOTS
    assert all(r.headers["Retry-After"] == "1" and "(--max-queue-len 2)" in r.json()["error"]["message"]
               for r in busy)
    assert all(r.json()["usage"]["completion_tokens"] == 60 for r in ok)


def test_clients_times_requests_all_complete_and_counted(server):
    clients, each = 3, 3
    before = _wait_idle(server)
    got, errors = [], []

    def run(c):
        for m in range(each):
            body = {"prompt": f"{PROMPT}# client {c} request {m}\n", "max_tokens": 8 + m, "temperature": 0,
                    "ignore_eos": True}
            for _ in range(50):  # a 503 asks to retry after a second
                r = _post(server, "/v1/completions", {**body, "stream": bool(m % 2)})
                if r.status_code != 503:
                    break
                time.sleep(float(r.headers["Retry-After"]))
            if r.status_code != 200:
                errors.append(r.text)
                continue
            if m % 2:
                events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
                assert events[-1] == "[DONE]"
                assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
                got.append((c, m, len(events) - 1))
            else:
                assert r.json()["usage"]["completion_tokens"] == 8 + m
                got.append((c, m, 8 + m))

    threads = [threading.Thread(target=run, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert not errors
    assert sorted((c, m) for c, m, _ in got) == [(c, m) for c in range(clients) for m in range(each)]
    after = _wait_idle(server)
    assert after["requests"] - before["requests"] == clients * each
    assert after["completion_tokens"] - before["completion_tokens"] == sum(8 + m for _ in range(clients)
                                                                           for m in range(each))


def test_load_generator_counts_what_the_server_served(server):
    """``perf.serve_load`` (what ``dflash-jax serve-bench`` runs): its counts and acceptance are the server's."""
    before = _wait_idle(server)
    out = serve_load.run(server.base_url, "tiny", [PROMPT, PROMPT + "    "], concurrency=2, max_tokens=6)
    after = _wait_idle(server)
    assert out["requests"] == 2 and out["failed"] == 0
    assert out["output_tokens"] == after["completion_tokens"] - before["completion_tokens"]
    records = _new_records(before, after)
    assert out["accept_length"] == pytest.approx(np.mean([n / s for n, s, _ in records]), abs=1e-3)
    assert 0 < out["ttft_ms_p50"] <= out["ttft_ms_p99"] and 0 < out["tpot_ms_p50"] <= out["tpot_ms_p99"]


def test_percentile_is_numpys_linear():
    values = list(np.random.default_rng(0).exponential(size=37))
    for q in (0, 50, 90, 99, 100):
        assert serve_load.percentile(values, q) == pytest.approx(np.percentile(values, q))


# -- the server survives its clients --

def _health_ms(server, until: threading.Event, out: list):
    """Times GET /health (ms) over and over until ``until`` is set."""
    while not until.is_set():
        t = time.perf_counter()
        assert httpx.get(server.base_url + "/health", timeout=TIMEOUT_S).status_code == 200
        out.append(1000 * (time.perf_counter() - t))
        time.sleep(0.02)


def test_huge_bodies_and_prompts_are_refused_before_tokenizing(server, monkeypatch):
    """A 5 MB prompt is a 413 once the body passes the cap, /health answering meanwhile; a prompt under the cap
    but over the characters any prompt that fits can have is a 400 without the tokenizer being called."""
    served = server.served
    calls = []
    encode = served.tokenizer.encode
    monkeypatch.setattr(served.tokenizer, "encode", lambda *a, **k: calls.append(1) or encode(*a, **k))
    stop, health = threading.Event(), []
    poller = threading.Thread(target=_health_ms, args=(server, stop, health))
    poller.start()
    try:
        huge = _post(server, "/v1/completions", {"prompt": "def f():\n" * 550_000, "max_tokens": 4})  # 5 MB
    finally:
        stop.set()
        poller.join(TIMEOUT_S)
    assert huge.status_code == 413, huge.text
    assert f"over {served.max_body_bytes} bytes" in huge.json()["error"]["message"]
    assert health and max(health) < 1000, health
    over = "x" * (served.max_prompt_chars + 1)
    for path, body in (("/v1/completions", {"prompt": over}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": over}]})):
        r = _post(server, path, body)
        assert r.status_code == 400 and f"more than {served.max_prompt_chars}" in r.json()["error"]["message"]
    assert not calls  # refused by length before any tokenizing
    assert _post(server, "/v1/completions", {"prompt": "x" * 20, "max_tokens": 1}).status_code == 200 and calls


def test_a_slow_tokenize_blocks_neither_health_nor_another_clients_stream(server, monkeypatch):
    """Tokenizing runs on the request threads: while one request's prompt takes seconds to encode, /health
    answers at once and another client's stream runs to its end."""
    tok, encode = server.served.tokenizer, server.served.tokenizer.encode
    entered, release = threading.Event(), threading.Event()

    def slow(text, *a, **k):
        if text.startswith("SLOW"):
            entered.set()
            release.wait(TIMEOUT_S)
        return encode(text, *a, **k)

    monkeypatch.setattr(tok, "encode", slow)
    result = {}
    t = threading.Thread(target=lambda: result.update(r=_post(server, "/v1/completions",
                                                              {"prompt": "SLOW " + PROMPT, "max_tokens": 2})))
    t.start()
    try:
        assert entered.wait(TIMEOUT_S)
        start = time.perf_counter()
        assert httpx.get(server.base_url + "/health", timeout=TIMEOUT_S).status_code == 200
        health_s = time.perf_counter() - start
        body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=TIMEOUT_S) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        assert not result  # the slow request is still tokenizing: nothing waited for it
        assert health_s < 1.0
    finally:
        release.set()
        t.join(TIMEOUT_S)
    assert result["r"].status_code == 200


def test_a_whole_response_client_that_leaves_frees_its_slot(server):
    """A non-streaming client that disconnects (as a client timing out does) cancels its request: the slot is
    free long before max_tokens, and the record says abort."""
    before = _wait_idle(server)
    max_tokens = MAX_LEN - 20
    body = json.dumps({"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 1.0, "seed": 5,
                       "ignore_eos": True}).encode()
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + TIMEOUT_S
        while not server.engine.stats()["active"]:  # running: the client leaves now
            assert time.monotonic() < deadline
            time.sleep(0.002)
    after = _wait_idle(server)
    (record,) = _new_records(before, after)
    tokens, _, reason = record
    assert reason == "abort" and tokens < max_tokens // 2, record


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", b'{"prompt": "def \\ud800(x):", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": "x", "stop": ["\\udfff"], "max_tokens": 2}', "stop[0]"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}',
     "messages[0].content[0].text"),
])
def test_a_lone_surrogate_is_a_400_without_a_traceback(server, path, body, param):
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    loggers = [logging.getLogger(n) for n in ("uvicorn.error", "uvicorn", "dflash_jax.serve", "")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        r = _post(server, path, body)
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and "surrogate" in error["message"]
    assert not records, [rec.getMessage() for rec in records]


def test_a_stop_string_is_counted_as_stop_up_to_the_token_that_completed_it(server, client):
    """/stats records a stop-string finish as stop, with the client's completion_tokens, and meta_info's
    verify steps and accepted drafts count nothing after that token (each step emits its accepted drafts and a
    bonus, so the last one kept may end inside a step's drafts)."""
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=60, temperature=0,
              extra_body={"ignore_eos": True, "return_meta_info": True})
    full = client.completions.create(**kw)
    text = full.choices[0].text
    fmeta = full.model_extra["meta_info"]
    checked = 0
    for cut in range(8, 40, 7):
        stop = text[cut:cut + 2]
        if text.find(stop) != cut:
            continue
        before = _wait_idle(server)
        out = client.completions.create(stop=[stop], **kw)
        after = _wait_idle(server)
        meta, n = out.model_extra["meta_info"], out.usage.completion_tokens
        assert out.choices[0].text == text[:cut] and out.choices[0].finish_reason == "stop"
        assert _new_records(before, after) == [(n, meta["spec_verify_ct"], "stop")]
        assert after["completion_tokens"] - before["completion_tokens"] == n < full.usage.completion_tokens
        assert after["accepted_drafts"] - before["accepted_drafts"] == meta["spec_accept_token_num"]
        steps, accepted = meta["spec_verify_ct"], meta["spec_accept_token_num"]
        assert 1 <= steps <= fmeta["spec_verify_ct"] and n - 1 - steps <= accepted <= n - steps
        checked += 1
    assert checked >= 2


def test_stats_bounds_its_list_of_records(server):
    stats = server.engine.stats()
    assert stats["finished_kept"] == 1024 and len(stats["finished"]) <= 1024
    assert stats["slots"] == SLOTS


def test_the_prefix_cache_and_chunk_flags_reach_the_engine(server):
    assert server.engine.chunk == CHUNK and server.engine.buckets() == [16, CHUNK]
    assert httpx.get(server.base_url + "/stats").json()["prefix_cache"]["capacity_bytes"] == 64 * 2**20


def test_the_block_is_chosen_each_step_and_the_table_is_in_stats_and_the_log(server):
    """No --block-size: every step ran plain decoding or the drafter's block, as the schedule chose for its rows
    from the costs timed at warm-up; /stats shows the table, the choices and the acceptance, the log the table."""
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", timeout=TIMEOUT_S, max_retries=0)
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0)
    stats = httpx.get(server.base_url + "/stats").json()
    spec = stats["speculation"]
    assert spec["options"] == ["1", "16"] and spec["rows"] == [SLOTS] and stats["block_size"] == 16
    assert set(spec["step_ms"][str(SLOTS)]) == {"1", "16"} and min(spec["step_ms"][str(SLOTS)].values()) > 0
    assert sum(spec["counts"].values()) == stats["engine_steps"] > 0 and spec["current"]["choice"] in ("1", "16")
    assert len(spec["acceptance"]) == 15 and spec["expected_tokens"]["1"] == 1.0
    assert any(n.startswith("speculation by load: step costs") and "E[tokens/step]" in n for n in server.notes)


# -- as vLLM users meet it --

NEUTRAL_CHAT = {"logprobs": False, "top_logprobs": 0, "presence_penalty": 0, "frequency_penalty": 0.0,
                "repetition_penalty": 1, "logit_bias": {}, "response_format": {"type": "text"}, "min_tokens": 0,
                "tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}],
                "tool_choice": "none", "parallel_tool_calls": False}


def test_neutral_fields_are_accepted_as_vllm_accepts_them(server):
    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    want = _post(server, "/v1/chat/completions", chat).json()["choices"][0]["message"]["content"]
    r = _post(server, "/v1/chat/completions", {**chat, **NEUTRAL_CHAT})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == want
    r = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "echo": False, "best_of": 1,
                                          "logprobs": None, "suffix": None, "presence_penalty": 0})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path, field, value", [
    ("/v1/chat/completions", "logprobs", True),
    ("/v1/completions", "logprobs", 0),  # vLLM returns the sampled token's log-probability for 0
    ("/v1/chat/completions", "presence_penalty", 0.5),
    ("/v1/completions", "frequency_penalty", -1),
    ("/v1/chat/completions", "logit_bias", {"5": 100}),
    ("/v1/chat/completions", "response_format", {"type": "json_object"}),
    ("/v1/chat/completions", "tool_choice", "auto"),
    ("/v1/completions", "echo", True),
    ("/v1/completions", "best_of", 2),
])
def test_other_values_of_those_fields_are_refused_by_name(server, path, field, value):
    body = {"prompt": "x"} if "chat" not in path else {"messages": [{"role": "user", "content": "x"}]}
    r = _post(server, path, {**body, "max_tokens": 2, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert f"'{field}' must be" in r.json()["error"]["message"]


def test_64_bit_seeds_reproduce(server, client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=12, temperature=1.0, extra_body={"ignore_eos": True})
    for seed in (2**63 - 1, -(2**63), 2**40 + 3):
        a = client.completions.create(seed=seed, **kw).choices[0].text
        assert client.completions.create(seed=seed, **kw).choices[0].text == a
    assert _post(server, "/v1/completions", {"prompt": "x", "seed": 2**63}).json()["error"]["param"] == "seed"


def test_role_only_in_the_first_streamed_delta(server):
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=TIMEOUT_S) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant", "content": ""} and len(deltas) > 2
    assert all("role" not in d for d in deltas[1:]) and deltas[-1] == {}
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_a_completion_without_max_tokens_is_clamped_to_the_context(server):
    tok = server.served.tokenizer
    ids = (frontend.encode(tok, PROMPT) * MAX_LEN)[:MAX_LEN - 5]
    r = _post(server, "/v1/completions", {"prompt": ids, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5  # the context's rest, under the default 16
    short = _post(server, "/v1/completions", {"prompt": PROMPT, "ignore_eos": True}).json()
    assert short["usage"]["completion_tokens"] == 16  # OpenAI's and vLLM's default
    r = _post(server, "/v1/completions", {"prompt": ids, "max_tokens": 6})  # asked for: still refused
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


# -- serve-bench's load generator and command against the server --

def test_load_generator_retries_503s_after_retry_after_and_keeps_its_figures(server):
    before = _wait_idle(server)
    n = 3 * (SLOTS + QUEUE)
    out = serve_load.run(server.base_url, "tiny", [PROMPT] * n, concurrency=n, max_tokens=24)
    after = _wait_idle(server)
    assert out["failed"] == 0 and out["requests"] == n and out["retries"] >= 1, out
    assert out["output_tokens"] == after["completion_tokens"] - before["completion_tokens"]
    capped = serve_load.run(server.base_url, "tiny", [PROMPT] * n, concurrency=n, max_tokens=24, max_retries=0)
    assert capped["failed"] >= 1 and capped["requests"] == n - capped["failed"] and capped["retries"] == 0
    assert "HTTP 503 after 0 retries" in capped["errors"][0] and capped["tokens_per_s"] > 0


def test_serve_bench_command(server, tmp_path, capsys):
    url = server.base_url
    assert main(["report", "serve-bench", "--server", f"a={url}", "--server", f"a={url}"]) == 2
    assert "the label 'a' is given twice" in capsys.readouterr().err
    assert main(["report", "serve-bench", "--server", f"a={url}", "--concurrency", "0"]) == 2
    assert "--concurrency: every value must be >= 1" in capsys.readouterr().err
    out, prompts = tmp_path / "bench.json", tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}(x):\n"}) + "\n" for i in range(3)))
    assert main(["report", "serve-bench", "--server", f"a={url}", "--concurrency", "1,6", "--num-prompts", "6",
                 "--max-tokens", "4", "--rounds", "1", "--prompts", str(prompts), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["server"], r["concurrency"], r["failed"]) for r in rows] == [("a", 1, 0), ("a", 6, 0)]
    assert rows[1]["rounds"][0]["requests"] == 6  # 6 at once over 2 slots and a queue of 2: any 503 retried
    assert rows[1]["retries"] == rows[1]["rounds"][0]["retries"]
    assert "| a | 6 |" in capsys.readouterr().out


def test_a_repeated_prompt_reports_the_tokens_its_prefix_cache_held(server, client):
    """usage.prompt_tokens_details.cached_tokens, whole and streamed, is what the engine resumed from its prefix
    cache (the growth of /stats' prefix_cache.cached_tokens): none the first time, some the second."""
    prompt = "".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(4))
    kw = dict(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    before = _wait_idle(server)["prefix_cache"]["cached_tokens"]
    first = client.completions.create(**kw).usage
    again = client.completions.create(**kw).usage
    (streamed,) = [c.usage for c in client.completions.create(stream=True, stream_options={"include_usage": True},
                                                              **kw) if c.usage]
    after = _wait_idle(server)["prefix_cache"]["cached_tokens"]
    cached = [u.prompt_tokens_details.cached_tokens for u in (first, again, streamed)]
    assert cached[0] == 0 and 0 < cached[1] == cached[2] < first.prompt_tokens, cached
    assert after - before == sum(cached)


# -- agent turns, bad roles and tools, huge numbers --

# A chat template that shows what it is given: the tools' names, each message's role and content, an assistant's
# tool calls with an argument read from the arguments object (a JSON string would have no field), a tool result's id.
# (Newlines as expressions: transformers renders with trim_blocks, which drops one right after a tag.)
AGENT_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} a={{ c.function.arguments.a }}]{% endfor %}"
    "{% if m.tool_call_id %}(for {{ m.tool_call_id }}){% endif %}{{ '\\n' }}{% endfor %}<assistant>")
ADD_TOOL = {"type": "function", "function": {"name": "add", "description": "a + b",
                                             "parameters": {"type": "object", "properties": {"a": {}, "b": {}}}}}
AGENT_TURN = [{"role": "system", "content": "You add."}, {"role": "user", "content": "1 + 2?"},
              {"role": "assistant", "content": None, "tool_calls": [
                  {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
              {"role": "tool", "tool_call_id": "call_1", "content": "3"}]


def test_an_agent_turn_is_rendered_by_the_chat_template_with_its_tools(server, client, monkeypatch):
    """An assistant message with content null and tool_calls, then a tool result, through the openai client: the
    template gets them (arguments as an object) and the tools; the reply is the completion of what it rendered."""
    tok = server.served.tokenizer
    monkeypatch.setattr(tok, "chat_template", AGENT_TEMPLATE)
    rendered = "TOOLS: add\n<system>You add.\n<user>1 + 2?\n<assistant>[call add a=1]\n<tool>3(for call_1)\n<assistant>"
    kw = dict(model="tiny", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(messages=AGENT_TURN, tools=[ADD_TOOL], **kw)
    assert chat.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))
    assert chat.choices[0].message.content == client.completions.create(prompt=rendered, **kw).choices[0].text
    monkeypatch.setattr(tok, "chat_template", None)  # no template: the contents, and the calls as JSON, by lines
    raw = client.chat.completions.create(messages=AGENT_TURN, tools=[ADD_TOOL], **kw)
    lines = ["You add.", "1 + 2?", json.dumps({"name": "add", "arguments": {"a": 1, "b": 2}}), "3"]
    assert raw.usage.prompt_tokens == len(tok.encode("\n".join(lines), add_special_tokens=False))


@pytest.mark.parametrize("messages, extra, param", [
    ([{"role": "wizard", "content": "hi"}], {}, "messages[0].role"),
    ([{"role": "user", "content": "hi"}], {"tools": [{"type": "function"}]}, "tools[0].function"),
    ([{"role": "user", "content": "hi"}], {"tools": [{"type": "retrieval", "function": {"name": "f"}}]},
     "tools[0].type"),
    ([{"role": "user", "content": "hi"}], {"tools": [{"type": "function", "function": {"name": ""}}]},
     "tools[0].function"),
    ([{"role": "user", "content": None}], {}, "messages[0].content"),
    ([{"role": "user", "content": "hi", "tool_calls": AGENT_TURN[2]["tool_calls"]}], {}, "messages[0].tool_calls"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"type": "function"}]}], {},
     "messages[0].tool_calls[0]"),
    ([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{not json"}}]}], {},
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "tool", "content": "3"}], {}, "messages[0].tool_call_id"),
])
def test_bad_roles_tool_calls_and_tools_are_400s_naming_the_field(server, messages, extra, param):
    r = _post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and f"'{param}" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("path, field", [("/v1/completions", "max_tokens"), ("/v1/completions", "seed"),
                                         ("/v1/completions", "top_k"), ("/v1/completions", "n"),
                                         ("/v1/completions", "temperature"),
                                         ("/v1/chat/completions", "max_completion_tokens")])
def test_numbers_of_thousands_of_digits_are_400s_naming_the_field(server, path, field):
    """Past Python's int-digits limit (4300) JSON's integers cannot be converted: a 400 in OpenAI's shape naming the
    field (was a plain-text 500); under it, a 400 whose message gives the number's length, not its digits."""
    body = {"prompt": PROMPT} if "chat" not in path else {"messages": [{"role": "user", "content": PROMPT}]}
    for digits in (5001, 4000):
        raw = json.dumps(body)[:-1].encode() + b', "%s": %s}' % (field.encode(), b"9" * digits)
        r = _post(server, path, raw)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        message = r.json()["error"]["message"]
        assert f"{digits} digits" in message and len(message) < 300, message


# -- clients that leave or dawdle --

def _logged(*names):
    """A handler collecting the records of the loggers ``names`` (attached; ``detach`` removes it)."""
    records = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    loggers = [logging.getLogger(n) for n in names]
    for lg in loggers:
        lg.addHandler(handler)
    return records, lambda: [lg.removeHandler(handler) for lg in loggers]


def _connect(server):
    host, port = server.base_url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=TIMEOUT_S)


def test_a_client_that_leaves_mid_body_is_one_quiet_line(server):
    records, detach = _logged("uvicorn", "")  # uvicorn's own (it does not propagate), and everything else
    try:
        with _connect(server) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n" + b'{"prompt": "')
            time.sleep(0.2)  # the app is reading the body
        deadline = time.monotonic() + TIMEOUT_S
        while not any("left after" in r.getMessage() for r in records):
            assert time.monotonic() < deadline, [r.getMessage() for r in records]
            time.sleep(0.05)
        time.sleep(0.2)  # anything else it would log comes now
    finally:
        detach()
    (line,) = [r for r in records if r.levelno >= logging.INFO]
    assert line.levelno == logging.INFO and "left after 12 bytes of its request's body" in line.getMessage()
    assert not line.exc_info


def test_idle_and_slow_connections_are_closed_after_the_read_timeout(server):
    """Nothing sent, headers in part, a body in part, and headers in part after a whole request: each connection
    is closed --read-timeout seconds on (the slow body with a 408), while a prompt client is answered."""
    openings = [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b'{"prompt"']
    socks = [_connect(server) for _ in openings]
    kept = _connect(server)  # a whole request on a kept-alive connection, then part of the next one's headers
    kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert kept.recv(4096).startswith(b"HTTP/1.1 200")
    kept.sendall(b"GET /health HTTP/1.1\r\n")
    socks.append(kept)
    try:
        for sock, opening in zip(socks, openings + [b""], strict=True):
            sock.sendall(opening)
        assert _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1}).status_code == 200
        replies = []
        for sock in socks:
            sock.settimeout(READ_TIMEOUT_S + 30)  # far past the bound: a connection left open fails here
            data = b""
            while chunk := sock.recv(4096):
                data += chunk
            replies.append(data)
    finally:
        for sock in socks:
            sock.close()
    assert replies[0] == replies[1] == replies[3] == b""
    assert replies[2].startswith(b"HTTP/1.1 408") and b"--read-timeout" in replies[2]
