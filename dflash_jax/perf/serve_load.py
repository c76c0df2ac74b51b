"""A load generator for an OpenAI-compatible server (``dflash-jax serve``, vLLM, SGLang): latency as users see it.

Sits beside ``bench.py`` (which times the compiled loop in-process) for the serving side: it sends chat
requests with ``stream: true`` from ``concurrency`` threads over the standard library's HTTP client and
times each one from the request to its first content chunk (TTFT) and from there to its last token
(per output token: (last - first) / (tokens - 1), vLLM's TPOT), and the whole run's output tokens per
second. Token counts come from the stream's ``usage`` chunk, the acceptance length from SGLang's
``meta_info`` when the server sends it (``return_meta_info``). A 503 (the server's queue is full) is retried
after its ``Retry-After`` (at most ``MAX_RETRIES`` times, each wait at most ``MAX_RETRY_AFTER_S``), and a
request's times count from its first try, as its user waits; a request that still fails is counted and
reported, not raised, so one failure does not lose the run's other figures. No timing is asserted anywhere:
the front end (``cli/serve_bench.py``) prints the figures of configurations measured side by side.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import statistics
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

MAX_RETRIES = 30  # 503s retried per request
MAX_RETRY_AFTER_S = 60.0  # the longest Retry-After honoured (a longer or missing one waits this long / 1 s)
KEPT_ERRORS = 5  # failure messages a run keeps


class RequestFailed(Exception):
    """A request that did not complete (an HTTP error, a 503 past ``MAX_RETRIES``, a broken stream)."""


@dataclasses.dataclass(frozen=True)
class Timing:
    """One request: seconds to its first content chunk, per output token after it, tokens, acceptance length,
    503s retried first."""

    ttft: float
    tpot: float
    tokens: int
    accept_length: float | None
    retries: int = 0


def retry_after(value: str | None) -> float:
    """Seconds to wait for a ``Retry-After`` header (seconds; a date or nothing reads as 1), at most
    ``MAX_RETRY_AFTER_S``."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = 1.0
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


def one_request(base_url: str, model: str, text: str, max_tokens: int, timeout: float = 600.0,
                max_retries: int = MAX_RETRIES, sleep=time.sleep) -> Timing:
    """Streams one greedy chat completion of ``text`` and times it from its first try; a 503 is retried after
    its Retry-After, at most ``max_retries`` times; ``RequestFailed`` when it does not complete."""
    url = urllib.parse.urlsplit(base_url)
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "return_meta_info": True}
    start = time.perf_counter()
    for retries in range(max_retries + 1):
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
        try:
            conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status == 200:
                return _timed(base_url, response, start, retries)
            detail = response.read()[:300]
        except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError) as e:
            raise RequestFailed(f"{base_url}: {type(e).__name__}: {e}") from None
        finally:
            conn.close()
        if response.status != 503:
            raise RequestFailed(f"{base_url}: HTTP {response.status}: {detail!r}")
        if retries < max_retries:
            sleep(retry_after(response.getheader("Retry-After")))
    raise RequestFailed(f"{base_url}: HTTP 503 after {max_retries} retries: {detail!r}")


def _timed(base_url: str, response, start: float, retries: int) -> Timing:
    """The timing of a 200 response's event stream (``start``: the request's first try)."""
    first = last = None
    tokens, accept = 0, None
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
        accept = event.get("meta_info", {}).get("spec_accept_length", accept)
        if any(c["delta"].get("content") for c in event.get("choices", [])):
            last = time.perf_counter()
            first = first or last
    if first is None:
        raise RequestFailed(f"{base_url}: a completion with no text")
    return Timing(ttft=first - start, tpot=(last - first) / max(tokens - 1, 1), tokens=tokens, accept_length=accept,
                  retries=retries)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between the sorted values."""
    values = sorted(values)
    x = (len(values) - 1) * q / 100
    lo = int(x)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (x - lo)


def run(base_url: str, model: str, texts: list[str], *, concurrency: int, max_tokens: int,
        max_retries: int = MAX_RETRIES) -> dict:
    """Sends every text (``concurrency`` at a time); the run's figures over the requests that completed: output
    tokens/s, TTFT and TPOT p50/p99 (ms), mean acceptance length (None without meta_info; every figure None when
    none completed), and ``failed`` (with the first ``KEPT_ERRORS`` messages) and ``retries`` (503s retried)."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")

    def one(text):
        try:
            return one_request(base_url, model, text, max_tokens, max_retries=max_retries)
        except RequestFailed as e:
            return str(e)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, texts))
    wall = time.perf_counter() - start
    timings = [t for t in results if isinstance(t, Timing)]
    errors = [e for e in results if isinstance(e, str)]
    accepts = [t.accept_length for t in timings if t.accept_length is not None]
    ms = lambda values, q: round(1000 * percentile(values, q), 2) if values else None  # noqa: E731
    return dict(requests=len(timings), failed=len(errors), errors=errors[:KEPT_ERRORS],
                retries=sum(t.retries for t in timings), concurrency=concurrency,
                output_tokens=sum(t.tokens for t in timings), seconds=round(wall, 3),
                tokens_per_s=round(sum(t.tokens for t in timings) / wall, 2) if timings else None,
                ttft_ms_p50=ms([t.ttft for t in timings], 50), ttft_ms_p99=ms([t.ttft for t in timings], 99),
                tpot_ms_p50=ms([t.tpot for t in timings], 50), tpot_ms_p99=ms([t.tpot for t in timings], 99),
                accept_length=round(statistics.mean(accepts), 3) if accepts else None)
