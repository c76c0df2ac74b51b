"""The OpenAI-compatible HTTP front end of the serving engine: a Starlette app, served by uvicorn.

Sits on top of ``engine.py``: each request's body is read up to a cap, its JSON checked (unknown fields and
bad values are a 400 that names them; fields OpenAI and vLLM clients send are accepted at their neutral
values and refused by name otherwise), its prompt bounded by characters and encoded (chat messages by the
tokenizer's chat template; without one as raw text, as ``generate --chat-template auto`` encodes a prompt),
all of it on one worker thread, never on the event loop; it becomes an engine ``Job``. The engine's thread
decodes the text as tokens arrive (``TextStream``) and ends the job at the request's stop strings, so the
engine's counters and the client's ``usage`` agree; text deltas come back through an asyncio queue.
Routes: ``POST /v1/chat/completions`` and ``/v1/completions`` (whole responses, or server-sent events with
``stream: true``), ``GET /v1/models``, ``GET /health`` and ``GET /stats`` (the engine's counters). Besides
OpenAI's ``usage``, a request with ``return_meta_info: true`` gets SGLang's ``meta_info``
(``spec_verify_ct``: target verify steps; ``spec_accept_length``: completion tokens per verify step), which
z-lab's benchmark client reads. A full queue is a 503 with ``Retry-After``; a client that leaves
mid-request (streaming or not) cancels its job, which frees its slot at the next step; one that leaves while
sending its body is one line in the log; a body that has not arrived ``read_timeout`` seconds after its headers
is a 408. Chat messages are OpenAI's, agent turns included (an assistant's ``tool_calls``, ``tool`` results;
the tool calls' arguments handed to the template as objects, as vLLM does). Usage reports the prompt tokens
the engine found in its prefix cache (``prompt_tokens_details.cached_tokens``). An engine that fails fails
``/health`` at once and asks the server to stop (``server.py``: ``dflash-jax serve`` then exits with 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import math
import numbers
import os
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from dflash_jax.decoding.sampling import SamplingConfig
from dflash_jax.decoding.text import TextStream
from dflash_jax.serve.engine import Closed, Engine, Finish, Job, QueueFull

log = logging.getLogger("dflash_jax.serve")

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # vLLM's range (a 64-bit integer); the engine keys on it modulo 2**64
DISCONNECT_POLL_S = 0.5  # how often a streaming request checks that its client is still there
RETRY_AFTER_S = 1
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions (clamped to the context)
ESCAPED_BYTES_PER_CHAR = 12  # the most a JSON string spends on one character ("\\ud83d\\ude00")
BODY_SLACK_BYTES = 2**20  # the body cap's room for everything but the prompt's characters
REQUEST_THREADS = 4  # threads that parse and tokenize requests
ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's chat roles
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "stream", "stream_options", "n",
          "user", "return_meta_info", "ignore_eos"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "chat_template_kwargs", "tools", "parallel_tool_calls"}
COMPLETION_FIELDS = COMMON | {"prompt"}


def _is(value, neutral) -> bool:
    """``value`` is ``neutral`` (None and booleans by identity, so 0 is not false; numbers by value)."""
    if neutral is None or isinstance(neutral, bool):
        return value is neutral
    if isinstance(neutral, numbers.Real):
        return isinstance(value, numbers.Real) and not isinstance(value, bool) and value == neutral
    return value == neutral


# Fields OpenAI and vLLM clients send that this server does not implement: accepted at the values that ask for
# nothing (None always), refused by name otherwise. Name -> (neutral values, what is missing, routes).
NEUTRAL = {
    "logprobs": ((False,), "log-probabilities are not returned", "both"),
    "top_logprobs": ((0,), "log-probabilities are not returned", "both"),
    "presence_penalty": ((0,), "penalties are not supported", "both"),
    "frequency_penalty": ((0,), "penalties are not supported", "both"),
    "repetition_penalty": ((1,), "penalties are not supported", "both"),
    "min_tokens": ((0,), "min_tokens is not supported", "both"),
    "logit_bias": (({},), "logit_bias is not supported", "both"),
    "response_format": (({"type": "text"},), "structured output is not supported", "both"),
    "tool_choice": (("none",), "this server does not parse tool calls", "chat"),
    "echo": ((False,), "echo is not supported", "completion"),
    "best_of": ((1,), "best_of is not supported", "completion"),
    "suffix": (("",), "suffix is not supported", "completion"),
}


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

    @functools.cached_property
    def token_chars(self) -> int:
        """The most characters one token covers: its vocabulary's longest entry (a byte-level BPE entry is one
        character per byte, and a character is at least a byte), added tokens included."""
        return max(1, max(len(t) for t in self.tokenizer.get_vocab()))

    @property
    def max_prompt_chars(self) -> int:
        """A prompt (the messages' contents, or the rendered chat) longer than this cannot fit the context:
        it encodes to more than ``max_model_len`` tokens. Checked before anything is tokenized."""
        return self.max_model_len * self.token_chars

    @property
    def max_body_bytes(self) -> int:
        """The request body cap: a prompt of ``max_prompt_chars`` characters, each escaped, and room for the rest."""
        return ESCAPED_BYTES_PER_CHAR * self.max_prompt_chars + BODY_SLACK_BYTES


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


def _error(status: int, message: str, param: str | None = None, headers: dict | None = None) -> Response:
    """OpenAI's error shape; ASCII-escaped JSON, so no text a client sent can make the answer itself fail."""
    kind = {400: "invalid_request_error", 404: "not_found_error", 408: "invalid_request_error",
            413: "invalid_request_error", 503: "service_unavailable"}.get(status, "error")
    body = json.dumps({"error": {"message": message, "type": kind, "param": param, "code": status}})
    return Response(body, status_code=status, headers=headers, media_type="application/json")


def _surrogate(value, path: str) -> str | None:
    """The path of the first string (key or value) in ``value`` holding a lone surrogate ("\\ud800"), which
    JSON's escapes allow and no tokenizer or UTF-8 encoder takes; None when there is none."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
    elif isinstance(value, dict):
        for k, v in value.items():
            where = f"{path}.{k}" if path else str(k)
            if (hit := _surrogate(k, where) or _surrogate(v, where)) is not None:
                return hit
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if (hit := _surrogate(v, f"{path}[{i}]")) is not None:
                return hit
    return None


def _neutral(body: dict, chat: bool) -> None:
    """Fields of ``NEUTRAL`` at anything but their neutral values: a 400 naming the first."""
    for name, (values, missing, route) in NEUTRAL.items():
        if name not in body or body[name] is None:
            continue
        if route != "both" and (route == "chat") != chat:
            continue
        if not any(_is(body[name], v) for v in values):
            shown = " or ".join(json.dumps(v) for v in values)
            raise BadRequest(f"'{name}' must be {shown} or null here ({missing}), got {json.dumps(body[name])}", name)
    if chat and not isinstance(body.get("parallel_tool_calls", False), bool | None):
        raise BadRequest("'parallel_tool_calls' must be true or false", "parallel_tool_calls")


class Digits:
    """A JSON integer of more digits than Python converts (``sys.get_int_max_str_digits``): no field takes one."""

    def __init__(self, text: str):
        self.digits = len(text.lstrip("-"))

    def __repr__(self) -> str:
        return f"an integer of {self.digits} digits"


def _json_int(text: str):
    limit = sys.get_int_max_str_digits()
    return Digits(text) if limit and len(text.lstrip("-")) > limit else int(text)


def _shown(value) -> str:
    """``value`` as an error message shows it: an integer of over 30 digits by its length."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"an integer of {len(str(abs(value)))} digits"
    return repr(value)


def _finite(value: numbers.Real) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer past float's range
        return False


def _number(body: dict, name: str, default, *, low=None, high=None, integer=False, open_low=False):
    """``body[name]`` checked as a number (an integer with ``integer``) in [low, high] (``open_low``: > low)."""
    value = body.get(name, default)
    if value is None:
        return default
    ok = isinstance(value, numbers.Integral if integer else numbers.Real) and not isinstance(value, bool)
    ok = ok and (integer or _finite(value))
    if ok and low is not None:
        ok = value > low if open_low else value >= low
    if ok and high is not None:
        ok = value <= high
    if not ok:
        kind = "an integer" if integer else "a number"
        lo = "" if low is None else f" {'>' if open_low else '>='} {low}"
        hi = "" if high is None else f"{' and' if lo else ''} <= {high}"
        raise BadRequest(f"'{name}' must be {kind}{lo}{hi}, got {_shown(value)}", name)
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
    """A message's content: a string, or a list of text parts joined (an assistant's tool-call turn: none, "")."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    if content is None and message.get("tool_calls"):
        return ""
    raise BadRequest(f"'messages[{i}].content' must be a string or a list of text parts, got {content!r}",
                     f"messages[{i}].content")


def _tool_calls(calls, where: str) -> list[dict]:
    """An assistant's ``tool_calls`` checked, each call's ``arguments`` (OpenAI's JSON text) parsed to the object
    chat templates take (vLLM hands them over so)."""
    if not isinstance(calls, list):
        raise BadRequest(f"'{where}' must be a list of tool calls, got {calls!r}", where)
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise BadRequest(f"'{at}' must be an object with \"type\": \"function\" and a 'function' "
                             f"{{name, arguments}}, got {call!r}", at)
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise BadRequest(f"'{at}.function.name' must be a non-empty string", f"{at}.function.name")
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            raise BadRequest(f"'{at}.function.arguments' must be a JSON object (as a string, as OpenAI sends it), "
                             f"got {function.get('arguments')!r}", f"{at}.function.arguments")
        if (hit := _surrogate(arguments, f"{at}.function.arguments")) is not None:
            raise BadRequest(f"'{hit}' holds a lone UTF-16 surrogate, which is not text", hit)
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


def _turn(message, i: int) -> dict:
    """A message checked and put as chat templates take it: its role and content, an assistant's tool calls, a
    tool result's ``tool_call_id``, a ``name``."""
    where = f"messages[{i}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise BadRequest(f"'{where}' must be an object with a string 'role'", where)
    role = message["role"]
    if role not in ROLES:
        raise BadRequest(f"'{where}.role' must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
    turn = {"role": role, "content": _message_text(message, i)}
    if message.get("tool_calls") is not None:
        if role != "assistant":
            raise BadRequest(f"'{where}.tool_calls': only an assistant's message makes tool calls, this one is "
                             f"{role!r}", f"{where}.tool_calls")
        turn["tool_calls"] = _tool_calls(message["tool_calls"], f"{where}.tool_calls")
    if role == "tool":
        if not isinstance(message.get("tool_call_id"), str):
            raise BadRequest(f"'{where}.tool_call_id' must be the id of the tool call this message answers",
                             f"{where}.tool_call_id")
        turn["tool_call_id"] = message["tool_call_id"]
    if message.get("name") is not None:
        if not isinstance(message["name"], str):
            raise BadRequest(f"'{where}.name' must be a string", f"{where}.name")
        turn["name"] = message["name"]
    return turn


def _raw(turn: dict) -> str:
    """A turn as text for a tokenizer without a chat template: its content, or its tool calls as JSON lines."""
    calls = [json.dumps(c["function"]) for c in turn.get("tool_calls", ())]
    return "\n".join(([turn["content"]] if turn["content"] or not calls else []) + calls)


def _tools(tools) -> list | None:
    """``tools`` checked: OpenAI's function tools, each ``{"type": "function", "function": {"name", ...}}``."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise BadRequest(f"'tools' must be a list of tool objects, got {tools!r}", "tools")
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise BadRequest(f"'{at}' must be a tool object, got {tool!r}", at)
        if tool.get("type") != "function":
            raise BadRequest(f"'{at}.type' must be \"function\" (the only tool type), got {tool.get('type')!r}",
                             f"{at}.type")
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise BadRequest(f"'{at}.function' must be an object with a non-empty 'name' (and 'description', "
                             f"'parameters'), got {function!r}", f"{at}.function")
        if not isinstance(function.get("parameters", {}), dict):
            raise BadRequest(f"'{at}.function.parameters' must be a JSON Schema object", f"{at}.function.parameters")
    return tools


def _bounded(text: str, max_chars: int, max_model_len: int, field: str) -> str:
    """``text`` unless it is too long to fit the context in any encoding (checked before tokenizing it)."""
    if len(text) > max_chars:
        raise BadRequest(f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                         f"{len(text)} characters, more than {max_chars} (no token covers more than "
                         f"{max_chars // max_model_len}; --max-model-len {max_model_len})", field)
    return text


def encode_chat(tokenizer, messages, template_kwargs: dict, *, max_chars: int, max_model_len: int,
                tools: list | None = None) -> list[int]:
    """Token ids of a chat: rendered by the tokenizer's chat template (with ``tools`` when given; then encoded,
    special tokens as rendered), or, when it has none, the messages' text joined by newlines encoded as raw
    text (one user message: exactly what ``generate --chat-template auto`` encodes for its prompt). More than
    ``max_chars`` characters, in the contents or rendered, is refused before any tokenizing."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects", "messages")
    turns = [_turn(m, i) for i, m in enumerate(messages)]
    raw = [_raw(t) for t in turns]
    _bounded("".join(raw), max_chars, max_model_len, "messages")
    if getattr(tokenizer, "chat_template", None):
        extra = {"tools": tools} if tools else {}
        try:
            text = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False, **extra,
                                                 **template_kwargs)
        except Exception as e:  # the template's own error (jinja raises its own types): the caller's input
            raise BadRequest(f"the chat template failed on these messages: {e}", "messages") from None
    else:
        text = "\n".join(raw)
    return list(tokenizer.encode(_bounded(text, max_chars, max_model_len, "messages"), add_special_tokens=False))


def _prompt_ids(served: Served, body: dict, chat: bool) -> list[int]:
    tok = served.tokenizer
    if chat:
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise BadRequest("'chat_template_kwargs' must be an object", "chat_template_kwargs")
        return encode_chat(tok, body.get("messages"), kwargs, max_chars=served.max_prompt_chars,
                           max_model_len=served.max_model_len, tools=_tools(body.get("tools")))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        text = _bounded(prompt, served.max_prompt_chars, served.max_model_len, "prompt")
        return list(tok.encode(text, add_special_tokens=False))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if len(prompt) >= served.max_model_len:
            return prompt  # refused by its length, in ``parse``
        bad = [t for t in prompt if not 0 <= t < len(tok)]
        if bad:
            raise BadRequest(f"'prompt': token id {bad[0]} is outside the vocabulary 0..{len(tok) - 1}", "prompt")
        return prompt
    raise BadRequest("'prompt' must be a string, a list of token ids, or a list of one of either", "prompt")


def parse(served: Served, body, chat: bool) -> Ask:
    """A request body checked and turned into an ``Ask``; ``BadRequest`` names the first bad field."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    if (where := _surrogate(body, "")) is not None:
        raise BadRequest(f"'{where}' holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), which is "
                         f"not text", where)
    allowed = CHAT_FIELDS | set(NEUTRAL) if chat else COMPLETION_FIELDS | set(NEUTRAL)
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
    _neutral(body, chat)
    prompt = _prompt_ids(served, body, chat)
    limit, field = served.max_model_len, "messages" if chat else "prompt"
    if not prompt:
        raise BadRequest("the prompt encodes to no tokens", field)
    if len(prompt) >= limit:
        raise BadRequest(f"This model's maximum context length is {limit} tokens; the prompt has {len(prompt)} "
                         f"tokens, leaving none to generate (--max-model-len {limit})", field)
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, name, None, low=1, integer=True)
    if max_tokens is None:  # as vLLM: the rest of the context (a completion: its default 16, at most that)
        max_tokens = limit - len(prompt) if chat else min(COMPLETION_DEFAULT_MAX_TOKENS, limit - len(prompt))
    if len(prompt) + max_tokens > limit:
        raise BadRequest(f"This model's maximum context length is {limit} tokens; you requested "
                         f"{_shown(len(prompt) + max_tokens)} ({len(prompt)} in the prompt, {_shown(max_tokens)} in "
                         f"'{name}')", name)
    vocab = served.engine.loop.cfg.vocab_size
    temperature = _number(body, "temperature", 1.0, low=0)
    try:
        sampling = SamplingConfig(temperature=temperature,
                                  top_p=_number(body, "top_p", 1.0, low=0, high=1, open_low=True),
                                  top_k=_number(body, "top_k", 0, low=-1, high=vocab, integer=True) % (vocab + 1))
    except ValueError as e:  # e.g. a temperature so small that logits / temperature overflows
        raise BadRequest(f"'temperature': {e}", "temperature") from None
    seed = _number(body, "seed", None, low=SEED_MIN, high=SEED_MAX, integer=True)
    return Ask(prompt=prompt, max_tokens=max_tokens, sampling=sampling,
               seed=int.from_bytes(os.urandom(8)) if seed is None else int(seed),
               stop=_stop_strings(body), stop_ids=() if body.get("ignore_eos") else served.eos_ids,
               stream=body.get("stream", False), include_usage=bool(options.get("include_usage")),
               meta_info=body.get("return_meta_info", False))


class Reader:
    """A request's text, kept on the engine's thread: ``watch`` decodes each step's new tokens (``TextStream``)
    and tells the engine where a stop string ends the request; ``emit`` hands the settled text and, at the
    end, the ``Finish`` to the event loop's queue as (text delta, finish or None)."""

    def __init__(self, tokenizer, stops: tuple[str, ...], loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
        self.text, self.loop, self.queue, self.shown = TextStream(tokenizer, stops), loop, queue, 0

    def watch(self, tokens: list[int]) -> int | None:
        before = len(self.text.tokens)
        self.text.extend(tokens)
        return len(self.text.tokens) - before if self.text.stopped else None

    def emit(self, tokens: list[int], finish: Finish | None) -> None:
        if finish is not None:
            self.text.finish()
        delta, self.shown = self.text.text[self.shown:self.text.settled], max(self.shown, self.text.settled)
        if delta or finish is not None:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (delta, finish))


def _reason(finish: Finish) -> str:
    return {"nonfinite": "error"}.get(finish.reason, finish.reason)


async def _watch_disconnect(request: Request, job: Job) -> None:
    """Cancels ``job`` when the client goes (its body already read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancel()


async def _run(served: Served, ask: Ask, request: Request):
    """Runs ``ask`` on the engine: yields (text delta, None) as text settles, then ("", Finish) once. A client
    that leaves cancels the job: a whole response's client is watched for its disconnect; a stream's is
    checked whenever ``DISCONNECT_POLL_S`` passed (and its response fails to send). A job the engine left
    unanswered when it failed ends as "abort" then."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    reader = Reader(served.tokenizer, ask.stop, loop, queue)
    job = Job(prompt=ask.prompt, max_tokens=ask.max_tokens, sampling=ask.sampling, seed=ask.seed,
              stop_ids=ask.stop_ids, emit=reader.emit, watch=reader.watch)
    try:
        served.engine.submit(job)
    except QueueFull as e:
        raise BadRequest(f"the server is busy: {e}; retry later", status=503,
                         headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except Closed as e:
        raise BadRequest(str(e), status=503, headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    watcher = None if ask.stream else asyncio.create_task(_watch_disconnect(request, job))
    checked = time.monotonic()
    try:
        while True:
            try:
                delta, finish = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                delta, finish = "", None
                if request.app.state.engine_failed and queue.empty():
                    finish = Finish("abort", job.sent, *job.figures(job.sent), job.cached)
            if ask.stream and time.monotonic() - checked >= DISCONNECT_POLL_S:
                checked = time.monotonic()
                if await request.is_disconnected():
                    job.cancel()
            if delta:
                yield delta, None
            if finish is not None:
                yield "", finish
                return
    finally:
        job.cancel()  # no-op once finished; a client gone mid-stream (the generator closed) frees the slot
        if watcher is not None:
            watcher.cancel()


def _usage(ask: Ask, finish: Finish) -> dict:
    """OpenAI's usage, with the prompt tokens the engine took from its prefix cache (``cached_tokens``)."""
    return {"prompt_tokens": len(ask.prompt), "completion_tokens": finish.tokens,
            "total_tokens": len(ask.prompt) + finish.tokens,
            "prompt_tokens_details": {"cached_tokens": finish.cached}}


def _meta_info(served: Served, ask: Ask, finish: Finish, rid: str) -> dict:
    """SGLang's meta_info: the token counts, the finish reason and, when speculating, the acceptance figures
    (``spec_accept_length`` = completion tokens / verify steps, as SGLang reports it; the drafts are the tokens
    each step verified besides its anchor: block - 1 for a chain, a draft tree's N nodes), all counted up to the
    token that ended the request."""
    n, steps = finish.tokens, finish.steps
    meta = {"id": rid, "prompt_tokens": len(ask.prompt), "completion_tokens": n,
            "finish_reason": {"type": _reason(finish)}}
    if served.speculative:
        drafts = steps * served.engine.drafts_per_step
        meta.update(spec_verify_ct=steps, spec_accept_length=n / steps if steps else 0.0,
                    spec_accept_rate=finish.accepted / drafts if drafts else 0.0,
                    spec_accept_token_num=finish.accepted, spec_draft_token_num=drafts)
    return meta


def _sse(payload) -> str:
    return f"data: {json.dumps(payload) if not isinstance(payload, str) else payload}\n\n"


class Gone(Exception):
    """The client left before its request was whole: nothing to answer."""


async def _body(request: Request, cap: int, timeout: float | None) -> bytes:
    """The request's body, refused (413) once it is over ``cap`` bytes: by its Content-Length, else as it arrives;
    a 408 (and the connection closed) when it is not whole ``timeout`` seconds after the headers (None: no bound);
    ``Gone`` when the client leaves first."""
    length = request.headers.get("content-length", "")
    too_big = BadRequest(f"the request body is over {cap} bytes (the most a prompt that fits --max-model-len "
                         f"{request.app.state.served.max_model_len} can take)", status=413)
    if length.isdigit() and int(length) > cap:
        raise too_big
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > cap:
                    raise too_big
                chunks.append(chunk)
    except TimeoutError:
        raise BadRequest(f"the request body did not arrive within {timeout:g} s of its headers ({size} bytes "
                         f"came; --read-timeout)", status=408, headers={"Connection": "close"}) from None
    except ClientDisconnect:
        client = request.client
        log.info("a client%s left after %d bytes of its request's body: nothing to answer",
                 f" ({client.host}:{client.port})" if client else "", size)
        raise Gone from None
    return b"".join(chunks)


def _parse_body(served: Served, raw: bytes, chat: bool) -> Ask:
    """The body's JSON checked and its prompt encoded (on the request worker thread)."""
    try:
        body = json.loads(raw, parse_int=_json_int)
        return parse(served, body, chat)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # json.loads, or the walk over what it built
        raise BadRequest("the request body is nested too deeply") from None


async def _complete(request: Request, chat: bool) -> Response:
    served: Served = request.app.state.served
    try:
        raw = await _body(request, served.max_body_bytes, request.app.state.read_timeout)
        ask = await asyncio.get_running_loop().run_in_executor(request.app.state.worker, _parse_body, served, raw,
                                                               chat)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        events = _run(served, ask, request)
        first = await anext(events)  # submits: a full queue is a 503 before any response starts
    except BadRequest as e:
        return _error(e.status, str(e), e.param, e.headers)
    except Gone:
        return Response(status_code=400)  # never sent: its client is gone
    head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": served.model_name}

    if not ask.stream:
        parts, finish = [], None
        async for delta, done in _chain(first, events):
            parts.append(delta)
            finish = done or finish
        text = "".join(parts)
        reply = {**head, "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                      "finish_reason": _reason(finish), "logprobs": None} if chat else
                                     {"index": 0, "text": text, "finish_reason": _reason(finish), "logprobs": None}],
                 "usage": _usage(ask, finish)}
        if ask.meta_info:
            reply["meta_info"] = _meta_info(served, ask, finish, rid)
        return JSONResponse(reply)

    chunk_head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}

    def chunk(text: str | None, reason: str | None, role: bool = False) -> dict:
        """One streamed choice: chat deltas carry the role in the first chunk only, and no content at the end."""
        if not chat:
            return {**chunk_head, "choices": [{"index": 0, "text": text or "", "finish_reason": reason,
                                               "logprobs": None}]}
        delta = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        return {**chunk_head, "choices": [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}]}

    async def sse():
        if chat:
            yield _sse(chunk("", None, role=True))
        async for delta, finish in _chain(first, events):
            if finish is None:
                if delta:
                    yield _sse(chunk(delta, None))
                continue
            last = chunk(None if chat else "", _reason(finish))
            if ask.meta_info:
                last["meta_info"] = _meta_info(served, ask, finish, rid)
            yield _sse(last)
            if ask.include_usage:
                yield _sse({**chunk_head, "choices": [], "usage": _usage(ask, finish)})
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
    """200 while the engine runs; 503 once it failed (the server is then stopping)."""
    if request.app.state.engine_failed:
        return _error(503, "the engine failed (see the server's log); the server is stopping")
    return Response(status_code=200)


async def stats(request: Request) -> Response:
    return JSONResponse(request.app.state.served.engine.stats())


async def _watch_engine(app: Starlette, engine) -> None:
    """Waits for the engine's thread to end; ended while serving (the engine failed: it logged why and answered
    every request "abort"), fails ``/health`` and calls ``app.state.on_engine_failure`` (``server.make``: stop)."""
    await asyncio.to_thread(engine.wait)
    if not app.state.stopping:
        app.state.engine_failed = True
        log.error("the engine failed: /health answers 503 and the server stops")
        app.state.on_engine_failure()


def create_app(served: Served) -> Starlette:
    """The ASGI app over ``served``; the engine is started on startup and drained on shutdown, and watched
    between (``_watch_engine``). ``app.state.read_timeout``: the body's bound (``server.make`` sets both it and
    ``on_engine_failure``)."""
    @contextlib.asynccontextmanager
    async def lifespan(app):
        served.engine.start()
        watcher = asyncio.create_task(_watch_engine(app, served.engine))
        yield
        app.state.stopping = True
        await asyncio.to_thread(served.engine.close, True)
        await watcher
        app.state.worker.shutdown(wait=False)

    app = Starlette(routes=[
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/stats", stats, methods=["GET"]),
    ], lifespan=lifespan)
    app.state.served = served
    app.state.read_timeout, app.state.on_engine_failure = None, lambda: None
    app.state.stopping = app.state.engine_failed = False
    # every request's JSON and tokenizing, off the event loop, on a few threads (a fast tokenizer's encode
    # only reads its settings when they are unchanged, so encodes may overlap; a prompt is at most
    # ``max_prompt_chars`` characters, so no request holds a thread long)
    app.state.worker = ThreadPoolExecutor(REQUEST_THREADS, thread_name_prefix="dflash-jax-requests")
    return app
