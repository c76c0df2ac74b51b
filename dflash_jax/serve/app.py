"""The OpenAI-compatible HTTP front end of the serving engine: a Starlette app, served by uvicorn.

Sits on top of ``engine.py``: each request's JSON is checked (unknown fields and bad values are a 400 that
names them), its prompt encoded (chat messages by the tokenizer's chat template; without one as raw text,
as ``generate --chat-template auto`` encodes a prompt), and it becomes an engine ``Job`` whose tokens come
back through an asyncio queue. The text is decoded as tokens arrive (``TextStream``), cut at the request's
stop strings. Routes: ``POST /v1/chat/completions`` and ``/v1/completions`` (whole responses, or
server-sent events with ``stream: true``), ``GET /v1/models``, ``GET /health`` and ``GET /stats`` (the
engine's counters). Besides OpenAI's ``usage``, a request with ``return_meta_info: true`` gets SGLang's
``meta_info`` (``spec_verify_ct``: target verify steps; ``spec_accept_length``: completion tokens per
verify step), which z-lab's benchmark client reads. A full queue is a 503 with ``Retry-After``; a client
that leaves mid-request cancels its job, which frees its slot at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import numbers
import os
import time
import uuid

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from dflash_jax.decoding.sampling import SamplingConfig
from dflash_jax.decoding.text import TextStream
from dflash_jax.serve.engine import Closed, Engine, Finish, Job, QueueFull

log = logging.getLogger("dflash_jax.serve")

SEED_MAX = 2**31 - 1  # seeds become int32 keys
DISCONNECT_POLL_S = 0.5  # how often a waiting request checks that its client is still there
RETRY_AFTER_S = 1
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "stream", "stream_options", "n",
          "user", "return_meta_info", "ignore_eos"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "chat_template_kwargs"}
COMPLETION_FIELDS = COMMON | {"prompt"}


class BadRequest(Exception):
    """A request the server refuses: ``status`` (400, 404, 503), the message and the field it names."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, headers: dict | None = None):
        super().__init__(message)
        self.param, self.status, self.headers = param, status, headers


@dataclasses.dataclass(frozen=True)
class Served:
    """What the app serves: the engine, the tokenizer, the model's name and stop ids, the context length."""

    engine: Engine
    tokenizer: object
    model_name: str
    eos_ids: tuple[int, ...]
    speculative: bool  # the engine drafts (block > 1): meta_info carries the acceptance figures

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len


@dataclasses.dataclass(frozen=True)
class Ask:
    """One checked request: the prompt's token ids and every setting the engine and the text need."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingConfig
    seed: int
    stop: tuple[str, ...]
    stop_ids: tuple[int, ...]
    stream: bool
    include_usage: bool
    meta_info: bool


def _error(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    kind = {400: "invalid_request_error", 404: "not_found_error", 503: "service_unavailable"}.get(status, "error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status, headers=headers)


def _number(body: dict, name: str, default, *, low=None, high=None, integer=False, open_low=False):
    """``body[name]`` checked as a number (an integer with ``integer``) in [low, high] (``open_low``: > low)."""
    value = body.get(name, default)
    if value is None:
        return default
    ok = isinstance(value, numbers.Integral if integer else numbers.Real) and not isinstance(value, bool)
    ok = ok and (integer or math.isfinite(value))
    if ok and low is not None:
        ok = value > low if open_low else value >= low
    if ok and high is not None:
        ok = value <= high
    if not ok:
        kind = "an integer" if integer else "a number"
        lo = "" if low is None else f" {'>' if open_low else '>='} {low}"
        hi = "" if high is None else f"{' and' if lo else ''} <= {high}"
        raise BadRequest(f"'{name}' must be {kind}{lo}{hi}, got {value!r}", name)
    return value


def _stop_strings(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise BadRequest(f"'stop' must be a non-empty string or a list of up to 4 of them, got {stop!r}", "stop")
    return tuple(stops)


def _message_text(message, i: int) -> str:
    """A message's content: a string, or a list of text parts joined."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise BadRequest(f"'messages[{i}].content' must be a string or a list of text parts, got {content!r}",
                     f"messages[{i}].content")


def encode_chat(tokenizer, messages, template_kwargs: dict) -> list[int]:
    """Token ids of a chat: rendered by the tokenizer's chat template (then encoded, special tokens as
    rendered), or, when it has none, the messages' text joined by newlines encoded as raw text (one user
    message: exactly what ``generate --chat-template auto`` encodes for its prompt)."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects", "messages")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"'messages[{i}]' must be an object with a string 'role'", f"messages[{i}]")
        turns.append({"role": m["role"], "content": _message_text(m, i)})
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False, **template_kwargs)
        except Exception as e:  # the template's own error (jinja raises its own types): the caller's input
            raise BadRequest(f"the chat template failed on these messages: {e}", "messages") from None
    else:
        text = "\n".join(t["content"] for t in turns)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _prompt_ids(served: Served, body: dict, chat: bool) -> list[int]:
    tok = served.tokenizer
    if chat:
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise BadRequest("'chat_template_kwargs' must be an object", "chat_template_kwargs")
        return encode_chat(tok, body.get("messages"), kwargs)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return list(tok.encode(prompt, add_special_tokens=False))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < len(tok)]
        if bad:
            raise BadRequest(f"'prompt': token id {bad[0]} is outside the vocabulary 0..{len(tok) - 1}", "prompt")
        return prompt
    raise BadRequest("'prompt' must be a string, a list of token ids, or a list of one of either", "prompt")


def parse(served: Served, body, chat: bool) -> Ask:
    """A request body checked and turned into an ``Ask``; ``BadRequest`` names the first bad field."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"unknown field '{unknown[0]}' (this server accepts: {', '.join(sorted(allowed))})",
                         unknown[0])
    if (chat and "messages" not in body) or (not chat and "prompt" not in body):
        name = "messages" if chat else "prompt"
        raise BadRequest(f"'{name}' is required", name)
    model = body.get("model")
    if model is not None and model != served.model_name:
        raise BadRequest(f"The model '{model}' does not exist; this server serves '{served.model_name}'", "model",
                         status=404)
    if _number(body, "n", 1, low=1, high=1, integer=True) != 1:
        raise BadRequest("'n' must be 1", "n")
    for flag in ("stream", "return_meta_info", "ignore_eos"):
        if not isinstance(body.get(flag, False), bool):
            raise BadRequest(f"'{flag}' must be true or false, got {body[flag]!r}", flag)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise BadRequest(f"'stream_options' must be an object with 'include_usage', got {options!r}", "stream_options")
    prompt = _prompt_ids(served, body, chat)
    limit, field = served.max_model_len, "messages" if chat else "prompt"
    if not prompt:
        raise BadRequest("the prompt encodes to no tokens", field)
    if len(prompt) >= limit:
        raise BadRequest(f"This model's maximum context length is {limit} tokens; the prompt has {len(prompt)} "
                         f"tokens, leaving none to generate (--max-model-len {limit})", field)
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, name, None if chat else 16, low=1, integer=True)
    if max_tokens is None:
        max_tokens = limit - len(prompt)
    if len(prompt) + max_tokens > limit:
        raise BadRequest(f"This model's maximum context length is {limit} tokens; you requested "
                         f"{len(prompt) + max_tokens} ({len(prompt)} in the prompt, {max_tokens} in '{name}')", name)
    vocab = served.engine.loop.cfg.vocab_size
    temperature = _number(body, "temperature", 1.0, low=0)
    try:
        sampling = SamplingConfig(temperature=temperature,
                                  top_p=_number(body, "top_p", 1.0, low=0, high=1, open_low=True),
                                  top_k=_number(body, "top_k", 0, low=-1, high=vocab, integer=True) % (vocab + 1))
    except ValueError as e:  # e.g. a temperature so small that logits / temperature overflows
        raise BadRequest(f"'temperature': {e}", "temperature") from None
    seed = _number(body, "seed", None, low=0, high=SEED_MAX, integer=True)
    return Ask(prompt=prompt, max_tokens=max_tokens, sampling=sampling,
               seed=int.from_bytes(os.urandom(4)) & SEED_MAX if seed is None else seed,
               stop=_stop_strings(body), stop_ids=() if body.get("ignore_eos") else served.eos_ids,
               stream=body.get("stream", False), include_usage=bool(options.get("include_usage")),
               meta_info=body.get("return_meta_info", False))


@dataclasses.dataclass
class Outcome:
    """What a finished request reports: its tokens, text, finish reason and the engine's figures."""

    text: TextStream
    finish: Finish | None = None

    @property
    def reason(self) -> str:
        if self.text.stopped:
            return "stop"
        return {"abort": "abort", "nonfinite": "error"}.get(self.finish.reason, self.finish.reason)


async def _run(served: Served, ask: Ask, request: Request):
    """Runs ``ask`` on the engine: yields (text delta, None) as text settles, then ("", Outcome) once."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def emit(tokens, finish):  # the engine's thread
        loop.call_soon_threadsafe(queue.put_nowait, (tokens, finish))

    job = Job(prompt=ask.prompt, max_tokens=ask.max_tokens, sampling=ask.sampling, seed=ask.seed,
              stop_ids=ask.stop_ids, emit=emit)
    try:
        served.engine.submit(job)
    except QueueFull as e:
        raise BadRequest(f"the server is busy: {e}; retry later", status=503,
                         headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except Closed as e:
        raise BadRequest(str(e), status=503, headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    out = Outcome(TextStream(served.tokenizer, ask.stop))
    shown = 0
    try:
        while out.finish is None:
            try:
                tokens, finish = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    job.cancel()
                continue
            out.text.extend(tokens)
            if out.text.stopped:
                job.cancel()  # the engine frees the slot at its next step; its finish comes back as usual
            out.finish = finish
            if finish is not None:
                out.text.finish()
            if out.text.settled > shown:
                yield out.text.text[shown:out.text.settled], None
                shown = out.text.settled
        yield "", out
    finally:
        job.cancel()  # no-op once finished; a client gone mid-stream (the generator closed) frees the slot


def _usage(ask: Ask, out: Outcome) -> dict:
    n = len(out.text.tokens)
    return {"prompt_tokens": len(ask.prompt), "completion_tokens": n, "total_tokens": len(ask.prompt) + n}


def _meta_info(served: Served, ask: Ask, out: Outcome, rid: str) -> dict:
    """SGLang's meta_info: the token counts, the finish reason and, when speculating, the acceptance figures
    (``spec_accept_length`` = completion tokens / verify steps, as SGLang reports it)."""
    n, steps = len(out.text.tokens), out.finish.steps
    meta = {"id": rid, "prompt_tokens": len(ask.prompt), "completion_tokens": n,
            "finish_reason": {"type": out.reason}}
    if served.speculative:
        drafts = steps * (served.engine.loop.spec.block_size - 1)
        meta.update(spec_verify_ct=steps, spec_accept_length=n / steps if steps else 0.0,
                    spec_accept_rate=out.finish.accepted / drafts if drafts else 0.0,
                    spec_accept_token_num=out.finish.accepted, spec_draft_token_num=drafts)
    return meta


def _sse(payload) -> str:
    return f"data: {json.dumps(payload) if not isinstance(payload, str) else payload}\n\n"


async def _complete(request: Request, chat: bool) -> Response:
    served: Served = request.app.state.served
    try:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"the request body is not valid JSON: {e}") from None
        ask = parse(served, body, chat)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        events = _run(served, ask, request)
        first = await anext(events)  # submits: a full queue is a 503 before any response starts
    except BadRequest as e:
        return _error(e.status, str(e), e.param, e.headers)
    head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": served.model_name}

    def choice(text: str, reason: str | None, final: bool = True) -> dict:
        if chat:
            key = "message" if final else "delta"
            return {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": reason,
                    "logprobs": None}
        return {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}

    if not ask.stream:
        parts, out = [], None
        async for delta, done in _chain(first, events):
            parts.append(delta)
            out = done or out
        reply = {**head, "choices": [choice("".join(parts), out.reason)], "usage": _usage(ask, out)}
        if ask.meta_info:
            reply["meta_info"] = _meta_info(served, ask, out, rid)
        return JSONResponse(reply)

    chunk_head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}

    async def sse():
        if chat:
            yield _sse({**chunk_head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                   "finish_reason": None, "logprobs": None}]})
        async for delta, out in _chain(first, events):
            if out is None:
                if delta:
                    yield _sse({**chunk_head, "choices": [choice(delta, None, final=False)]})
                continue
            last = {**chunk_head, "choices": [choice(delta, out.reason, final=False)]}
            if chat:
                last["choices"][0]["delta"] = {}
            if ask.meta_info:
                last["meta_info"] = _meta_info(served, ask, out, rid)
            yield _sse(last)
            if ask.include_usage:
                yield _sse({**chunk_head, "choices": [], "usage": _usage(ask, out)})
        yield _sse("[DONE]")

    return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _chain(first, rest):
    yield first
    async for item in rest:
        yield item


async def chat_completions(request: Request) -> Response:
    return await _complete(request, chat=True)


async def completions(request: Request) -> Response:
    return await _complete(request, chat=False)


async def models(request: Request) -> Response:
    served: Served = request.app.state.served
    return JSONResponse({"object": "list", "data": [{"id": served.model_name, "object": "model", "created": 0,
                                                     "owned_by": "dflash-jax", "max_model_len": served.max_model_len}]})


async def health(request: Request) -> Response:
    return Response(status_code=200)


async def stats(request: Request) -> Response:
    return JSONResponse(request.app.state.served.engine.stats())


def create_app(served: Served) -> Starlette:
    """The ASGI app over ``served``; the engine is started on startup and drained on shutdown."""
    @contextlib.asynccontextmanager
    async def lifespan(app):
        served.engine.start()
        yield
        await asyncio.to_thread(served.engine.close, True)

    app = Starlette(routes=[
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/stats", stats, methods=["GET"]),
    ], lifespan=lifespan)
    app.state.served = served
    return app
