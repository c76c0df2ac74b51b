"""The HTTP server on the shipped pair, driven by the official ``openai`` client and by raw HTTP (httpx):
the OpenAI shapes (whole and streamed), the per-request settings, and the faults (bad JSON, unknown
fields, a prompt over the context, a full queue, a client that leaves mid-stream, many clients at once)."""

import json
import threading
import time

import httpx
import numpy as np
import openai
import pytest
from serve_fixtures import running

from dflash_jax.decoding import runtime
from dflash_jax.perf import serve_load

MAX_LEN = 128
SLOTS = 2
QUEUE = 2
TIMEOUT_S = 300  # a bound on any one request, far above its need
PROMPT = "def fibonacci(n):\n"


@pytest.fixture(scope="module")
def server():
    with running("--max-num-seqs", str(SLOTS), "--max-model-len", str(MAX_LEN), "--max-queue-len", str(QUEUE),
                 "--block-size", "8", "--served-model-name", "tiny") as r:
        yield r


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", timeout=TIMEOUT_S, max_retries=0)


def _post(server, path, body, **kw):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.base_url + path, content=content, timeout=TIMEOUT_S,
                      headers={"Content-Type": "application/json"}, **kw)


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
    ids = runtime.encode(tok, PROMPT, "auto")
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
    assert all(r.headers["Retry-After"] == "1" and "--max-queue" in r.json()["error"]["message"] for r in busy)
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
    assert out["requests"] == 2
    assert out["output_tokens"] == after["completion_tokens"] - before["completion_tokens"]
    records = after["finished"][len(before["finished"]):]
    assert out["accept_length"] == pytest.approx(np.mean([n / s for n, s, _ in records]), abs=1e-3)
    assert 0 < out["ttft_ms_p50"] <= out["ttft_ms_p99"] and 0 < out["tpot_ms_p50"] <= out["tpot_ms_p99"]


def test_percentile_is_numpys_linear():
    values = list(np.random.default_rng(0).exponential(size=37))
    for q in (0, 50, 90, 99, 100):
        assert serve_load.percentile(values, q) == pytest.approx(np.percentile(values, q))
