"""A load generator for an OpenAI-compatible server (``dflash-jax serve``, vLLM, SGLang): latency as users see it.

Sits beside ``bench.py`` (which times the compiled loop in-process) for the serving side: it sends chat
requests with ``stream: true`` from ``concurrency`` threads over the standard library's HTTP client and
times each one from the request to its first content chunk (TTFT) and from there to its last token
(per output token: (last - first) / (tokens - 1), vLLM's TPOT), and the whole run's output tokens per
second. Token counts come from the stream's ``usage`` chunk, the acceptance length from SGLang's
``meta_info`` when the server sends it (``return_meta_info``). No timing is asserted anywhere: the front
end (``cli/serve_bench.py``) prints the figures of configurations measured side by side.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import statistics
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor


@dataclasses.dataclass(frozen=True)
class Timing:
    """One request: seconds to its first content chunk, per output token after it, tokens, acceptance length."""

    ttft: float
    tpot: float
    tokens: int
    accept_length: float | None


def one_request(base_url: str, model: str, text: str, max_tokens: int, timeout: float = 600.0) -> Timing:
    """Streams one greedy chat completion of ``text`` and times it."""
    url = urllib.parse.urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "return_meta_info": True}
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"{base_url}: HTTP {response.status}: {response.read()[:300]!r}")
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
    conn.close()
    if first is None:
        raise RuntimeError(f"{base_url}: a completion with no text")
    return Timing(ttft=first - start, tpot=(last - first) / max(tokens - 1, 1), tokens=tokens, accept_length=accept)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between the sorted values."""
    values = sorted(values)
    x = (len(values) - 1) * q / 100
    lo = int(x)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (x - lo)


def run(base_url: str, model: str, texts: list[str], *, concurrency: int, max_tokens: int) -> dict:
    """Sends every text (``concurrency`` at a time); the run's figures: output tokens/s, TTFT and TPOT p50/p99 (ms),
    mean acceptance length (None without meta_info)."""
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        timings = list(pool.map(lambda t: one_request(base_url, model, t, max_tokens), texts))
    wall = time.perf_counter() - start
    accepts = [t.accept_length for t in timings if t.accept_length is not None]
    ms = lambda values, q: round(1000 * percentile(values, q), 2)
    return dict(requests=len(timings), concurrency=concurrency, output_tokens=sum(t.tokens for t in timings),
                seconds=round(wall, 3), tokens_per_s=round(sum(t.tokens for t in timings) / wall, 2),
                ttft_ms_p50=ms([t.ttft for t in timings], 50), ttft_ms_p99=ms([t.ttft for t in timings], 99),
                tpot_ms_p50=ms([t.tpot for t in timings], 50), tpot_ms_p99=ms([t.tpot for t in timings], 99),
                accept_length=round(statistics.mean(accepts), 3) if accepts else None)
