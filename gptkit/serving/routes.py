"""The OpenAI-compatible HTTP API over the continuous-batching engine (gptkit/serving/engine.py):

    GET  /v1/models              the one model served
    POST /v1/completions         text in, text out (a prompt may also be token ids, or a list of prompts)
    POST /v1/chat/completions    messages in, the assistant's reply out (gptkit/chat.py's template)
    GET  /health                 the engine's load (rows decoding, requests waiting), tokens decoded so far

Both POST routes answer as one JSON object or, with "stream": true, as server-sent events: `data: {chunk}`
lines, then `data: [DONE]`, as the OpenAI API does. Options: max_tokens (max_completion_tokens for chat),
temperature, top_p, stop (text-level), seed, n, stream_options.include_usage; the rest of OpenAI's options are
accepted at their default values only (a 400 names the others), and a few harmless ones (user, metadata, ...)
are ignored; an unknown one is a 400 too (a typo is not silently dropped). Every error is OpenAI's JSON,
{"error": {"message", "type", "param", "code"}}: 400 for a bad request, 404 for another model, 413 for a body
over 8 MiB, 429 when the queue is full, 503 while shutting down.

The path of a request: the JSON is checked field by field (`Job`), the prompt rendered to token ids, and each
choice (n per prompt) submitted to the engine as a request of its own, all or none: a full queue is a 429 at
once, never a wait. The engine decodes on its own thread and hands each token over to the event loop
(`Choices`); `ReplyText` turns a choice's tokens into text, whole characters only, and cuts it before the
first stop string (text that might begin one is held back while streaming). When the client goes away,
mid-stream or while waiting for a whole reply, its requests are cancelled: their rows are free before the next
decode step.

This module knows text, JSON and HTTP, no tensors. Starlette (the ASGI toolkit FastAPI is built on; uvicorn
serves it) rather than FastAPI: every check here answers OpenAI's 400 naming the field, which FastAPI's
pydantic layer would answer with its own 422 shape, so it would only be bypassed.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gptkit.chat import ChatError, ChatTokens, check_messages, prompt_ids
from gptkit.generate import SamplingOptions, TextStream
from gptkit.serving.engine import Engine, EngineStopped, Finished, QueueFull, Request, Token
from gptkit.shards import DataError

MAX_BODY_BYTES = 8 * 2**20  # a request's JSON; far above any prompt that fits a context, far below the RAM
MAX_STOPS = 4  # as OpenAI
MAX_STOP_CHARS = 1000  # each; holding back a stop string's beginnings costs time quadratic in its length
DEFAULT_COMPLETION_TOKENS = 16  # /v1/completions' default max_tokens, as OpenAI's (chat: the context's rest)
INT64 = 2**63

# ----------------------------------------------------------------------------- errors


class ApiError(Exception):
    """A request the server answers with an OpenAI-style JSON error."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def error_response(e: ApiError) -> JSONResponse:
    # A client told to slow down is told when to try again (the openai client honours Retry-After).
    headers = {"Retry-After": "1"} if e.status in (429, 503) else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


# ----------------------------------------------------------------------------- reading the request


async def read_json(request: HttpRequest) -> dict[str, Any]:
    """The body as a JSON object; a 413 past MAX_BODY_BYTES (read no further), a 400 for anything not JSON."""
    too_big = ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes", code="request_too_large")
    if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
        raise too_big
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise too_big

    def no_constant(name: str):  # NaN and Infinity are not JSON, though Python's parser takes them
        raise ValueError(f"{name} is not a JSON value")

    try:
        data = json.loads(bytes(body), parse_constant=no_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise bad(f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad("the request body must be a JSON object")
    return data


def _type_name(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


def get_int(body: dict, key: str, default: int | None, lo: int, hi: int) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():  # 16.0 is 16 to JavaScript clients
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad(f"{key} must be an integer, got {_type_name(value)}", key)
    if value < lo or value > hi:
        raise bad(f"{key} must be {f'at least {lo}' if value < lo else f'at most {hi}'}, got {value}", key)
    return value


def get_number(body: dict, key: str, default: float, lo: float, hi: float, *, open_lo: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise bad(f"{key} must be a number, got {_type_name(value)}", key)
    if not (lo < value if open_lo else lo <= value) or value > hi:
        raise bad(f"{key} must be in {'(' if open_lo else '['}{lo}, {hi}], got {value}", key)
    return float(value)


def get_bool(body: dict, key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"{key} must be a boolean, got {_type_name(value)}", key)
    return value


# OpenAI's options this server does not implement, each with the values that mean "not used": a request may
# send those (clients often send defaults explicitly) but nothing else, or it would silently get less than
# it asked for.
def _off(*values: Any):
    return lambda v: v in values or v == {} or v == []


UNSUPPORTED = {
    "frequency_penalty": _off(None, 0), "presence_penalty": _off(None, 0), "logit_bias": _off(None),
    "logprobs": _off(None, False, 0),
}
UNSUPPORTED_COMPLETIONS = {"echo": _off(None, False), "best_of": _off(None, 1), "suffix": _off(None, "")}
UNSUPPORTED_CHAT = {
    "top_logprobs": _off(None, 0), "tools": _off(None), "tool_choice": _off(None, "none", "auto"),
    "functions": _off(None), "function_call": _off(None, "none", "auto"),
    "response_format": _off(None, {"type": "text"}), "modalities": _off(None, ["text"]), "audio": _off(None),
    "prediction": _off(None), "reasoning_effort": _off(None), "web_search_options": _off(None),
}
# Accepted and ignored: they change nothing in the reply.
HARMLESS = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
            "safety_identifier"}
COMMON = {"model", "max_tokens", "temperature", "top_p", "stop", "seed", "n", "stream", "stream_options"}


def check_keys(body: dict, supported: set[str], unsupported: dict) -> None:
    unknown = sorted(k for k in body if k not in supported | HARMLESS | unsupported.keys())
    if unknown:
        raise bad(f"unrecognized request argument(s): {', '.join(unknown)}", unknown[0])
    used = sorted(k for k, off in unsupported.items() if k in body and not off(body[k]))
    if used:
        them = "it" if len(used) == 1 else "them"
        raise bad(f"this server does not support {', '.join(used)} (leave {them} out, or at the default)",
                  used[0], code="unsupported_parameter")


# ----------------------------------------------------------------------------- a checked request


@dataclass
class Job:
    """What a request asks for, checked: prompts as token ids (each continued n times, prompt i's choices
    being indexes i*n .. i*n+n-1, as OpenAI numbers them), and how to decode them."""

    chat: bool
    prompts: list[list[int]]
    max_tokens: list[int]  # per prompt
    n: int
    sampling: SamplingOptions
    stops: list[str]
    stop_ids: frozenset[int]
    seed: int | None
    stream: bool
    include_usage: bool

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


@dataclass
class Stats:
    """What the server has done since it started, for /health."""

    replies: int = 0  # choices submitted to the engine
    generated_tokens: int = 0  # tokens the engine decoded for them (counted on the engine's thread only)


class Api:
    """The routes' handlers over one engine, its model's tokenizer and the name the model is served as."""

    def __init__(self, engine: Engine, tokenizer: Any, model_name: str):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.stats = Stats()
        self.block_size = engine.block_size
        self.created = int(time.time())
        try:
            self.chat_tokens: ChatTokens | None = ChatTokens.of(tokenizer)
            self.chat_problem = ""
        except ChatError as e:
            self.chat_tokens, self.chat_problem = None, str(e)

    # ---- the routes

    async def models(self, request: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: HttpRequest) -> Response:
        self._check_model(request.path_params["model"])
        return JSONResponse(self._model_card())

    async def health(self, request: HttpRequest) -> Response:
        active, waiting = self.engine.load
        return JSONResponse({"status": "ok", "model": self.model_name, "active": active, "waiting": waiting,
                             "max_batch": self.engine.max_batch, "max_queue": self.engine.max_queue,
                             "replies": self.stats.replies, "generated_tokens": self.stats.generated_tokens})

    async def completions(self, request: HttpRequest) -> Response:
        body = await read_json(request)
        check_keys(body, COMMON | {"prompt"}, {**UNSUPPORTED, **UNSUPPORTED_COMPLETIONS})
        return await self._answer(request, self._job(body, chat=False))

    async def chat_completions(self, request: HttpRequest) -> Response:
        body = await read_json(request)
        check_keys(body, COMMON | {"messages", "max_completion_tokens"}, {**UNSUPPORTED, **UNSUPPORTED_CHAT})
        if self.chat_tokens is None:
            raise bad(self.chat_problem, code="not_a_chat_model")
        return await self._answer(request, self._job(body, chat=True))

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "gptkit"}

    def _check_model(self, name: Any) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    # ---- checking a request

    def _job(self, body: dict, chat: bool) -> Job:
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise bad(f"model must be a string, got {_type_name(model)}", "model")
        self._check_model(model)  # left out: the one model served
        capacity = self.engine.max_batch + self.engine.max_queue
        n = get_int(body, "n", 1, 1, capacity)
        temperature = get_number(body, "temperature", 1.0, 0.0, 2.0)
        top_p = get_number(body, "top_p", 1.0, 0.0, 1.0, open_lo=True)
        sampling = SamplingOptions(temperature=temperature, top_p=top_p if top_p < 1 else None)
        seed = get_int(body, "seed", None, -INT64, INT64 - 1)
        stream = get_bool(body, "stream", False)
        include_usage = self._stream_options(body, stream)
        stops = self._stops(body.get("stop"))
        if chat:
            prompts = [self._chat_prompt(body.get("messages"))]
            stop_ids = self.chat_tokens.stop_ids
            max_tokens, param = self._chat_max_tokens(body)
        else:
            prompts = self._completion_prompts(body.get("prompt"))
            stop_ids = frozenset({self.tokenizer.eot_id} - {None})
            max_tokens, param = get_int(body, "max_tokens", None, 1, INT64 - 1), "max_tokens"
        if len(prompts) * n > capacity:
            raise bad(f"{len(prompts)} prompts times n={n} is {len(prompts) * n} replies; this server "
                      f"decodes at most {capacity} at once", "n")
        budgets = [self._budget(p, max_tokens, param, chat) for p in prompts]
        return Job(chat, prompts, budgets, n, sampling, stops, stop_ids, seed, stream, include_usage)

    def _stream_options(self, body: dict, stream: bool) -> bool:
        options = body.get("stream_options")
        if options is None:
            return False
        if not stream:
            raise bad("stream_options is only allowed when stream is true", "stream_options")
        if not isinstance(options, dict):
            raise bad(f"stream_options must be an object, got {_type_name(options)}", "stream_options")
        unknown = sorted(set(options) - {"include_usage"})
        if unknown:
            raise bad(f"stream_options: unrecognized option(s) {', '.join(unknown)}", "stream_options")
        return get_bool(options, "include_usage", False)

    def _stops(self, stop: Any) -> list[str]:
        if stop is None:
            return []
        stops = [stop] if isinstance(stop, str) else stop
        if not (isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)):
            raise bad("stop must be a non-empty string or an array of them", "stop")
        if len(stops) > MAX_STOPS:
            raise bad(f"stop holds {len(stops)} strings; at most {MAX_STOPS} are allowed", "stop")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise bad(f"a stop string has at most {MAX_STOP_CHARS} characters", "stop")
        return stops

    def _completion_prompts(self, prompt: Any) -> list[list[int]]:
        """OpenAI's four spellings: a string, an array of strings, an array of token ids, an array of
        those."""
        if isinstance(prompt, str):
            return [self._encode(prompt, "prompt")]
        if isinstance(prompt, list) and prompt:
            if all(isinstance(p, str) for p in prompt):
                return [self._encode(p, "prompt") for p in prompt]
            if all(_is_id(t) for t in prompt):
                return [self._ids(prompt)]
            if all(isinstance(p, list) and all(_is_id(t) for t in p) for p in prompt):
                return [self._ids(p) for p in prompt]
        raise bad("prompt must be a string, an array of strings, an array of token ids, or an array of "
                  "arrays of token ids (not empty)", "prompt")

    def _encode(self, text: str, param: str) -> list[int]:
        if not text:
            if self.tokenizer.eot_id is None:
                raise bad("the prompt is empty, and this model has no end-of-text token to start from", param)
            return [self.tokenizer.eot_id]  # where documents start, as sample.py's empty prompt
        try:
            return self.tokenizer.encode(text)
        except DataError as e:  # a character a char-level model does not know
            raise bad(str(e), param) from None

    def _ids(self, ids: list[int]) -> list[int]:
        vocab = self.tokenizer.vocab_size
        if not ids or not all(0 <= t < vocab for t in ids):
            raise bad(f"a prompt of token ids must be non-empty, each id in [0, {vocab})", "prompt")
        return list(ids)

    def _chat_prompt(self, messages: Any) -> list[int]:
        if isinstance(messages, list):
            messages = [_plain_message(m, i) for i, m in enumerate(messages)]
        try:
            return prompt_ids(check_messages(messages), self.tokenizer)
        except (ChatError, DataError) as e:
            raise bad(str(e), "messages") from None

    def _chat_max_tokens(self, body: dict) -> tuple[int | None, str]:
        new = get_int(body, "max_completion_tokens", None, 1, INT64 - 1)
        old = get_int(body, "max_tokens", None, 1, INT64 - 1)
        if new is not None and old is not None and new != old:
            raise bad(f"max_completion_tokens ({new}) and max_tokens ({old}) disagree; give one of them",
                      "max_completion_tokens")
        return (new, "max_completion_tokens") if new is not None else (old, "max_tokens")

    def _budget(self, prompt: list[int], max_tokens: int | None, param: str, chat: bool) -> int:
        """The reply's max_tokens: the prompt and its reply must fit the model's context together."""
        room = self.block_size - len(prompt)
        if room < 1:
            raise bad(f"the prompt has {len(prompt)} tokens, but the model's context is {self.block_size} "
                      f"tokens: at most {self.block_size - 1} leave room for a reply", "messages" if chat else
                      "prompt", code="context_length_exceeded")
        if max_tokens is None:
            return room if chat else min(DEFAULT_COMPLETION_TOKENS, room)
        if max_tokens > room:
            raise bad(f"{param} is {max_tokens}, but the prompt has {len(prompt)} tokens and the model's "
                      f"context is {self.block_size}: at most {room}", param, code="context_length_exceeded")
        return max_tokens

    # ---- answering

    async def _answer(self, request: HttpRequest, job: Job) -> Response:
        choices = Choices(self.engine, self.tokenizer, job, self.stats)
        choices.submit()  # before any byte is sent, so a full queue is a 429 even for a stream
        prefix = "chatcmpl-" if job.chat else "cmpl-"
        reply = Reply(f"{prefix}{uuid.uuid4().hex}", int(time.time()), self.model_name, job)
        if job.stream:
            return StreamingResponse(reply.events(choices.deltas()), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        collected = asyncio.ensure_future(reply.collect(choices.deltas()))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait([collected, gone], return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collected.done():  # the client left: its rows are freed (deltas' finally)
                collected.cancel()
                choices.cancel()
        if not collected.done() or collected.cancelled():
            return Response(status_code=499)  # nobody reads it
        return JSONResponse(collected.result())


def _is_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _plain_message(m: Any, i: int) -> Any:
    """OpenAI's message spellings -> {"role", "content"} with a string content: "developer" is the newer name
    of "system"; a content may be an array of text parts. Anything else goes to check_messages as it is."""
    if not isinstance(m, dict):
        return m
    role, content = m.get("role"), m.get("content")
    if role == "developer":
        role = "system"
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise bad(f"messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": ...}}) are "
                      f"supported", "messages")
        content = "".join(p["text"] for p in content)
    return {"role": role, "content": content}


async def _disconnected(request: HttpRequest) -> None:
    """Returns when the client has gone away (its body was read already: what comes next is the end)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ----------------------------------------------------------------------------- from tokens to text


class ReplyText:
    """One choice's tokens -> its text: whole characters only (TextStream), cut before the earliest stop
    string, which is not returned. Text that might be the beginning of a stop string is held back until the
    next tokens show it is not, so streamed text never has to be taken back; the pieces add up exactly to the
    whole reply."""

    def __init__(self, tokenizer: Any, stops: list[str]):
        self.stream = TextStream(tokenizer)
        self.stops = stops
        self.held = ""
        self.tokens = 0  # the tokens that made the reply (up to the one that completed a stop string)
        self.stopped = False  # a stop string was found: the reply is over

    def push(self, token: int) -> str:
        self.tokens += 1
        return self._cut(self.stream.push(token))

    def finish(self) -> str:
        """The end of the reply: whatever is held back."""
        text = self._cut(self.stream.flush())
        text, self.held = text + self.held, ""
        return text

    def _cut(self, new: str) -> str:
        text = self.held + new
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if found:
            self.stopped, self.held = True, ""
            return text[:min(found)]
        # Every occurrence of a stop string still to come starts in the longest suffix of the text that is a
        # prefix of one (what the earlier calls held back included): hold that suffix.
        keep = max((k for s in self.stops for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep]


@dataclass
class Delta:
    """A choice's next piece of text; finish_reason ("stop" or "length") on its last one."""

    index: int
    text: str
    finish_reason: str | None = None
    tokens: int = 0  # with finish_reason: the reply's completion tokens


class Choices:
    """A job's choices as engine requests; `deltas` yields their text as it comes. The engine calls each
    request's emit on its own thread: events are handed over to this event loop, into one queue."""

    def __init__(self, engine: Engine, tokenizer: Any, job: Job, stats: Stats):
        self.engine, self.job, self.stats = engine, job, stats
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue[tuple[int, Token | Finished]] = asyncio.Queue()
        self.texts = [ReplyText(tokenizer, job.stops) for _ in range(len(job.prompts) * job.n)]
        self.requests: list[Request] = []

    def submit(self) -> None:
        """Submit every choice, or none: a QueueFull (429) or a stopping engine (503) cancels those already
        in."""
        job = self.job
        try:
            for p, prompt in enumerate(job.prompts):
                for j in range(job.n):
                    index = p * job.n + j
                    # With a seed, choice i draws from seed + i: n choices, n different replies, reproducible.
                    seed = None if job.seed is None else job.seed + index
                    self.requests.append(self.engine.submit(Request(
                        prompt, job.max_tokens[p], emit=self._emitter(index), sampling=job.sampling,
                        stop_ids=job.stop_ids, seed=seed)))
            self.stats.replies += len(self.requests)
        except (QueueFull, EngineStopped, ValueError) as e:
            self.cancel()
            if isinstance(e, QueueFull):
                raise ApiError(429, f"the server is busy: {e}", type="rate_limit_error",
                               code="queue_full") from None
            if isinstance(e, EngineStopped):
                raise ApiError(503, str(e), type="server_error", code="shutting_down") from None
            raise bad(str(e), "prompt") from None  # engine.check: what the checks above let through

    def _emitter(self, index: int):
        def emit(event: Token | Finished) -> None:  # on the engine's thread
            if isinstance(event, Token):
                self.stats.generated_tokens += 1
            try:
                self.loop.call_soon_threadsafe(self.events.put_nowait, (index, event))
            except RuntimeError:  # the event loop is closed: nobody is waiting for this reply any more
                pass
        return emit

    def cancel(self) -> None:
        for r in self.requests:
            r.cancel()

    async def deltas(self) -> AsyncIterator[Delta]:
        """Each choice's text as it is decoded, in the order the tokens come; every choice ends with a Delta
        that has its finish_reason. Leaving early (a client gone) cancels the requests still running."""
        open_ = set(range(len(self.texts)))
        try:
            while open_:
                index, event = await self.events.get()
                if index not in open_:
                    continue  # a choice ended by a stop string: the tokens decoded before its cancel arrived
                text = self.texts[index]
                if isinstance(event, Token):
                    piece = text.push(event.id)
                    if text.stopped:
                        self.requests[index].cancel()
                        open_.discard(index)
                        yield Delta(index, piece, "stop", text.tokens)
                    elif piece:
                        yield Delta(index, piece)
                    continue
                if event.reason == "error":
                    raise ApiError(500, "the model failed while decoding this request (the server's log says "
                                        "why)", type="server_error")
                open_.discard(index)
                # "stop": a stop token was drawn; "length": max_tokens or the context is reached.
                yield Delta(index, text.finish(), event.reason, text.tokens)
        finally:
            self.cancel()  # a no-op for the finished ones


# ----------------------------------------------------------------------------- OpenAI's response shapes


@dataclass
class Reply:
    """Writes a job's deltas as OpenAI's JSON: one whole response, or the chunks of a stream."""

    id: str
    created: int
    model: str
    job: Job
    completion_tokens: int = 0

    def usage(self) -> dict[str, int]:
        prompt = self.job.prompt_tokens
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens}

    def _head(self, stream: bool) -> dict[str, Any]:
        if not self.job.chat:
            kind = "text_completion"  # streamed too
        else:
            kind = "chat.completion.chunk" if stream else "chat.completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    async def collect(self, deltas: AsyncIterator[Delta]) -> dict[str, Any]:
        count = len(self.job.prompts) * self.job.n
        texts: list[list[str]] = [[] for _ in range(count)]
        reasons: list[str | None] = [None] * count
        async for d in deltas:
            texts[d.index].append(d.text)
            if d.finish_reason:
                reasons[d.index] = d.finish_reason
                self.completion_tokens += d.tokens
        choices = []
        for i, (pieces, reason) in enumerate(zip(texts, reasons)):
            text = "".join(pieces)
            if self.job.chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                "logprobs": None, "finish_reason": reason})
            else:
                choices.append({"index": i, "text": text, "logprobs": None, "finish_reason": reason})
        return {**self._head(False), "choices": choices, "usage": self.usage()}

    def _chunk(self, index: int, text: str | None, finish_reason: str | None, role: bool = False) -> dict:
        if self.job.chat:
            if role:
                delta = {"role": "assistant", "content": ""}
            else:
                delta = {} if text is None else {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        chunk = {**self._head(True), "choices": [choice]}
        if self.job.include_usage:
            chunk["usage"] = None  # as OpenAI: every chunk has it, the last one (no choices) fills it
        return chunk

    async def events(self, deltas: AsyncIterator[Delta]) -> AsyncIterator[bytes]:
        """The server-sent events of a stream; a failure mid-stream is an error event, and no [DONE]."""
        try:
            if self.job.chat:  # OpenAI's first chunk of each choice gives the role
                for i in range(len(self.job.prompts) * self.job.n):
                    yield _sse(self._chunk(i, None, None, role=True))
            async for d in deltas:
                if d.text:
                    yield _sse(self._chunk(d.index, d.text, None))
                if d.finish_reason:
                    self.completion_tokens += d.tokens
                    yield _sse(self._chunk(d.index, None, d.finish_reason))
            if self.job.include_usage:
                yield _sse({**self._head(True), "choices": [], "usage": self.usage()})
            yield b"data: [DONE]\n\n"
        except ApiError as e:
            yield _sse(e.body())


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


# ----------------------------------------------------------------------------- the application


def create_app(engine: Engine, tokenizer: Any, model_name: str) -> Starlette:
    """The ASGI application serving `engine` (started by the caller, who also stops it) as `model_name`."""
    api = Api(engine, tokenizer, model_name)

    async def api_error(request: HttpRequest, e: ApiError) -> Response:
        return error_response(e)

    async def http_error(request: HttpRequest, e: HTTPException) -> Response:  # unknown route, wrong method
        return error_response(ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                                       code="not_found" if e.status_code == 404 else None))

    async def server_error(request: HttpRequest, e: Exception) -> Response:  # a bug: logged by uvicorn too
        return error_response(ApiError(500, f"internal server error ({type(e).__name__})",
                                       type="server_error"))

    routes = [
        Route("/v1/models", api.models),
        Route("/v1/models/{model:path}", api.model),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/health", api.health),
    ]
    return Starlette(routes=routes, exception_handlers={ApiError: api_error, HTTPException: http_error,
                                                        Exception: server_error})
