"""OpenAI-compatible HTTP on the router: POST /v1/completions, POST /v1/chat/completions (streamed
as server-sent events, or not), GET /v1/models, GET /health.

Each call becomes a GenerateRequest and is served by the router's own Generate or GenerateStream,
in this process and on its event loop: the same validation, Lua admission (a refusal is 429 with
Retry-After), placement, relay, cancellation, tracing and metrics as a gRPC call. A client that
disconnects cancels its request, which frees its KV everywhere, as a cancelled gRPC call does.
Starlette routes the calls and uvicorn serves them (h11), on a socket bound here."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import socket
import time

import grpc
import h11
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from splitserve.service.errors import PermissionDenied, status_for
from splitserve_proto.v1 import generation_pb2 as gen_pb

log = logging.getLogger(__name__)

# gRPC status -> (HTTP status, OpenAI's error type)
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "invalid_request_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
# HTTP statuses of this API's own (not a gRPC status's) -> OpenAI's error type
HTTP_ONLY = {408: "timeout_error", 413: "invalid_request_error"}
# The kernel's send buffer of each HTTP connection (bind)
SEND_BUFFER_BYTES = 64 << 10
# A request body nested deeper than this (objects and lists) is refused before anything walks it:
# a JSON Schema this deep compiles to nothing useful, and Python's own parser gives up near 1000.
MAX_BODY_DEPTH = 64
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "abort"}
# The request's parameters and where each goes in SamplingParams (the same name unless given)
SAMPLING = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "seed": int,
    "n": int,
    "presence_penalty": float,
    "frequency_penalty": float,
    "repetition_penalty": float,
    "min_tokens": int,
    "ignore_eos": bool,
    "include_stop_str_in_output": bool,
    "skip_special_tokens": bool,
    "truncate_prompt_tokens": int,
    "prompt_logprobs": int,
}
# A field a servicer's error names -> the request's parameter
PARAMS = {"token_ids": "prompt", "sampling.structured_output": "response_format", "request_id": "X-Request-Id"}


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


class HttpError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, headers=None):
        super().__init__(message)
        self.status, self.param, self.code, self.headers = status, param, code, headers or {}


def bad(param: str, message: str) -> HttpError:
    return HttpError(400, f"{param}: {message}", param, "INVALID_ARGUMENT")


def error_response(e: BaseException) -> JSONResponse:
    """OpenAI's error shape, with the HTTP status for the gRPC status the call would have had."""
    if not isinstance(e, HttpError):
        code, message, metadata = status_for(e)
        status, _ = HTTP_STATUS.get(code, (500, "internal_error"))
        headers = {}
        retry_ms = dict(metadata).get("retry-after-ms")
        if retry_ms is not None:
            headers["Retry-After"] = str(max(1, math.ceil(int(retry_ms) / 1000)))
        if status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        field = getattr(e, "field", None) or (message.split(":", 1)[0] if status == 400 and ":" in message else None)
        if field is not None:
            field = PARAMS.get(field, field.removeprefix("sampling."))
        e = HttpError(status, message, field, code.name, headers)
    kind = next((t for s, t in HTTP_STATUS.values() if s == e.status), HTTP_ONLY.get(e.status, "internal_error"))
    body = {"error": {"message": e.args[0], "type": kind, "param": e.param, "code": e.code}}
    return JSONResponse(body, status_code=e.status, headers=e.headers)


class HttpContext:
    """What the servicer reads of a gRPC call's context, for an HTTP call: the trace context of its
    headers, no deadline; and the span's name and attributes, the HTTP route's."""

    def __init__(self, request: Request, route: str):
        keep = ("traceparent", "tracestate", "authorization")
        self.metadata = tuple((k, v) for k, v in request.headers.items() if k in keep)
        self.span_name = f"{request.method} {route}"
        self.span_attributes = {"http.request.method": request.method, "http.route": route, "url.path": route}
        self.tenant = None  # its tenant, once authenticated (RouterServicer.authenticate)

    def invocation_metadata(self):
        return self.metadata

    def time_remaining(self):
        return None


def checked_body(body) -> None:
    """Refuses (400, naming where) a body nested deeper than MAX_BODY_DEPTH, or with a string or
    key holding a lone surrogate ("\\ud800" is valid JSON, but no Unicode text: it cannot be
    encoded to be tokenized, matched or sent on)."""
    todo = [(body, "", 0)]
    while todo:
        value, where, depth = todo.pop()
        if isinstance(value, str):
            _check_text(value, where or "body")
        elif isinstance(value, (dict, list)):
            if depth >= MAX_BODY_DEPTH:
                raise bad(where.split(".")[0].split("[")[0] or "body", f"nested deeper than {MAX_BODY_DEPTH} levels")
            if isinstance(value, dict):
                for k, v in value.items():
                    at = f"{where}.{k}" if where else k
                    _check_text(k, at)
                    todo.append((v, at, depth + 1))
            else:  # (a long list of numbers, a prompt's token ids, is passed over at C speed)
                todo.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value) if type(v) in _NESTED_TYPES)


_NESTED_TYPES = {str, list, dict}


def _check_text(text: str, where: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(
            where, f"holds a lone surrogate ({text[e.start]!r} at character {e.start}), which is not Unicode text"
        ) from None


def _set(msg, name: str, value, param: str | None = None) -> None:
    """msg.name = value, or 400 naming param when the field cannot hold it (an integer past its range)."""
    try:
        setattr(msg, name, value)
    except (ValueError, TypeError):
        raise bad(param or name, f"{value!r} is out of range") from None


def _typed(body: dict, name: str, kind, lo=None, hi=None):
    value = body.get(name)
    if value is None:
        return None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        what = {float: "a number", int: "an integer", bool: "a boolean"}[kind]
        raise bad(name, f"must be {what}, got {value!r}")
    if lo is not None and value < lo or hi is not None and value > hi:
        raise bad(name, f"must be in [{lo}, {hi}], got {value}")
    return value


def sampling_of(body: dict, chat: bool) -> gen_pb.SamplingParams:
    """The request's sampling parameters, each checked for its type here and for its range by the
    servicer (whose errors name the field). OpenAI's default temperature is 1."""
    sp = gen_pb.SamplingParams(temperature=1.0)
    for name, kind in SAMPLING.items():
        value = _typed(body, name, kind)
        if value is not None:
            _set(sp, name, value)
    for name in ("max_completion_tokens", "max_tokens"):
        if (value := _typed(body, name, int)) is not None:
            _set(sp, "max_tokens", value, name)
            break
    stop = body.get("stop")
    if isinstance(stop, str):
        sp.stop.append(stop)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        sp.stop.extend(stop)
    elif stop is not None:
        raise bad("stop", "must be a string or a list of strings")
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise bad("stop_token_ids", "must be a list of integers")
        try:
            sp.stop_token_ids.extend(ids)
        except ValueError:
            raise bad("stop_token_ids", "a token id is out of range") from None
    if chat:
        if _typed(body, "logprobs", bool):
            _set(sp, "logprobs", _typed(body, "top_logprobs", int) or 0, "top_logprobs")
        elif body.get("top_logprobs") is not None:
            raise bad("top_logprobs", "needs logprobs: true")
    elif (k := _typed(body, "logprobs", int)) is not None:
        _set(sp, "logprobs", k)
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise bad("logit_bias", "must be an object of token ids to biases")
        for token, value in bias.items():
            try:
                sp.logit_bias[int(token)] = float(value)
            except (TypeError, ValueError, OverflowError):
                raise bad("logit_bias", f"{token!r}: {value!r} is not a token id and a number") from None
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            sp.structured_output.json_object = True
        elif kind == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema") if isinstance(fmt.get("json_schema"), dict) else None
            if not isinstance(schema, dict):
                raise bad("response_format", "json_schema.schema must be a JSON Schema object")
            sp.structured_output.json_schema = json.dumps(schema)
        elif kind != "text":
            raise bad("response_format", f"type must be text, json_object or json_schema, got {kind!r}")
    return sp


def generate_request(body: dict, request: Request, chat: bool) -> gen_pb.GenerateRequest:
    req = gen_pb.GenerateRequest(sampling=sampling_of(body, chat))
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad("messages", "must be a non-empty list of messages")
        for i, m in enumerate(messages):
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):  # content parts: only text
                if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                    raise bad(f"messages[{i}].content", "only text parts are supported")
                content = "".join(str(p.get("text", "")) for p in content)
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, str):
                raise bad(f"messages[{i}]", "must be an object with a string role and content")
            req.messages.messages.add(role=m["role"], content=content)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            req.prompt = prompt
        elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            try:
                req.token_ids.ids.extend(prompt)
            except ValueError:
                raise bad("prompt", "a token id is out of range") from None
        else:
            raise bad("prompt", "must be a string, a list of token ids, or a list of one of those")
        for name in ("echo", "suffix"):
            if body.get(name):
                raise bad(name, "is not supported")
        if (best_of := body.get("best_of")) is not None and best_of != (body.get("n") or 1):
            raise bad("best_of", "is not supported (only best_of == n)")
    if (priority := _typed(body, "priority", int)) is not None:
        _set(req, "priority", priority)
    if (salt := body.get("cache_salt")) is not None:
        if not isinstance(salt, str):
            raise bad("cache_salt", "must be a string")
        req.cache_salt = salt
    req.request_id = request.headers.get("x-request-id", "")
    return req


def _text_offsets(texts: list[str]) -> list[int]:
    out, at = [], 0
    for t in texts:
        out.append(at)
        at += len(t)
    return out


def completion_logprobs(lps, offset: int = 0) -> dict:
    tokens = [lp.token for lp in lps]
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{t.token: t.logprob for t in lp.top_logprobs} for lp in lps],
        "text_offset": [offset + o for o in _text_offsets(tokens)],
    }


def chat_logprobs(lps) -> dict:
    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", "surrogatepass"))}

    return {
        "content": [
            entry(lp.token, lp.logprob) | {"top_logprobs": [entry(t.token, t.logprob) for t in lp.top_logprobs]}
            for lp in lps
        ]
    }


def usage_of(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def _disconnected(receive) -> None:
    """Returns once the client has gone (the request's body is read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _or_disconnect(coro, receive):
    """coro's result; or, once the client disconnects, coro cancelled (the request gives back what
    it held, as a cancelled gRPC call's does) and ClientGone."""
    work, gone = asyncio.ensure_future(coro), asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
            raise ClientGone()
        return work.result()
    finally:
        gone.cancel()
        if not work.done():  # this task itself was cancelled
            work.cancel()


class EventStream:
    """A server-sent event stream (an ASGI response) of what `chunks` yields; a client that
    disconnects cancels it at once, and the generator is closed before the response ends."""

    def __init__(self, chunks, headers: dict[str, str], send_timeout_s: float = 0.0):
        self.chunks, self.headers, self.send_timeout_s = chunks, headers, send_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        headers += [(k.lower().encode(), v.encode()) for k, v in self.headers.items()]
        await send({"type": "http.response.start", "status": 200, "headers": headers})

        async def pump():
            async for chunk in self.chunks:
                body = {"type": "http.response.body", "body": chunk.encode(), "more_body": True}
                if not self.send_timeout_s:
                    await send(body)
                    continue
                try:  # a client that takes nothing for that long (slow_reader_timeout_s) is cut off
                    await asyncio.wait_for(send(body), self.send_timeout_s)
                except TimeoutError:
                    log.info("an HTTP stream's client read nothing for %g s: closed", self.send_timeout_s)
                    raise ClientGone() from None
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            with contextlib.suppress(ClientGone, OSError):
                await _or_disconnect(pump(), receive)
        finally:
            await self.chunks.aclose()


def sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _closing(status: int, message: str) -> HttpError:
    """An error after which the connection is closed (the request's body is left unread)."""
    code = {408: "REQUEST_TIMEOUT", 413: "REQUEST_TOO_LARGE"}[status]
    return HttpError(status, message, None, code, {"Connection": "close"})


class OpenAIApi:
    """The routes, served from a servicer (RouterServicer) in its own process."""

    def __init__(
        self,
        servicer,
        model_name: str,
        context_length: int,
        max_body_bytes: int,
        body_timeout_s: float = 60.0,
        send_timeout_s: float = 0.0,
    ):
        self.servicer, self.model, self.context = servicer, model_name, context_length
        self.max_body_bytes, self.body_timeout_s, self.send_timeout_s = max_body_bytes, body_timeout_s, send_timeout_s
        self.created = int(time.time())
        self.serving = True
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
            ]
        )

    async def health(self, request: Request):
        if not self.serving:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request):
        try:
            self.servicer.authenticate(HttpContext(request, "/v1/models"), "ListModels")
        except Exception as e:  # noqa: BLE001 - UNAUTHENTICATED, PERMISSION_DENIED: in OpenAI's shape
            return error_response(e)
        card = {"id": self.model, "object": "model", "created": self.created, "owned_by": "splitserve",
                "max_model_len": self.context}  # fmt: skip
        return JSONResponse({"object": "list", "data": [card]})

    async def completions(self, request: Request):
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request):
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool):
        route = "/v1/chat/completions" if chat else "/v1/completions"
        try:
            ctx = HttpContext(request, route)
            self._identify(ctx)  # before the body is read: a caller without a token sends none
            body = await self._json_body(request)
            # authenticated (its RPC now known) before anything of the model is said
            ctx.tenant = self.servicer.authenticate(ctx, "GenerateStream" if body.get("stream") is True else "Generate")
            model = body.get("model")
            if model is not None and model != self.model:
                raise HttpError(404, f"model {model!r} is not served here (this server serves {self.model!r})",
                                "model", "model_not_found")  # fmt: skip
            req = generate_request(body, request, chat)
            req.model = model or ""
            stream = _typed(body, "stream", bool)
            options = body.get("stream_options") or {}
            if not isinstance(options, dict):
                raise bad("stream_options", "must be an object")
            include_usage = bool(options.get("include_usage"))
            if not stream:
                resp = await _or_disconnect(self.servicer.Generate(req, ctx), request.receive)
                return JSONResponse(self._whole(resp, chat), headers={"X-Request-Id": resp.request_id})
            chunks = self.servicer.GenerateStream(req, ctx)
            try:  # the first message before the response starts, so that a refusal gets its status
                first = await _or_disconnect(chunks.__anext__(), request.receive)
            except BaseException:
                await chunks.aclose()
                raise
            events = self._chunks(first, chunks, chat, include_usage)
            return EventStream(events, {"X-Request-Id": first.request_id}, self.send_timeout_s)
        except ClientGone:
            return JSONResponse({}, status_code=499)  # nothing reads this
        except Exception as e:  # noqa: BLE001 - every other error is answered in OpenAI's shape
            return error_response(e)

    def _identify(self, ctx: HttpContext) -> None:
        """UNAUTHENTICATED for a call without a known token, before its body is read (which RPC it
        is, and so whether its tenant may call it, is read from the body: authenticate)."""
        tenants = getattr(self.servicer, "tenants", None)
        if tenants is not None:
            with contextlib.suppress(PermissionDenied):
                tenants.authenticate(ctx.metadata, "Generate")

    async def _json_body(self, request: Request) -> dict:
        """The body as a JSON object, read up to max_body_bytes (413 past it: from Content-Length
        before a byte is read, or as it streams in) within body_timeout_s (408), then checked
        (checked_body). A refused body's connection is closed: the rest of it is never read."""
        limit = self.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise _closing(413, f"the body is {int(length)} bytes; at most {limit} are read (http_max_body_bytes)")
        chunks: list[bytes] = []

        async def read() -> None:
            size = 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _closing(413, f"the body is over {limit} bytes, the most read (http_max_body_bytes)")
                chunks.append(chunk)

        try:
            await asyncio.wait_for(read(), self.body_timeout_s)
        except TimeoutError:
            raise _closing(
                408, f"the body did not come within {self.body_timeout_s:g} s (http_body_timeout_s)"
            ) from None
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as e:
            raise HttpError(400, f"the body is not JSON: {e}", None, "INVALID_ARGUMENT") from None
        except RecursionError:
            raise bad("body", f"nested deeper than {MAX_BODY_DEPTH} levels") from None
        if not isinstance(body, dict):
            raise HttpError(400, "the body must be a JSON object", None, "INVALID_ARGUMENT")
        checked_body(body)
        return body

    def _whole(self, resp: gen_pb.GenerateResponse, chat: bool) -> dict:
        samples = list(resp.choices) or [resp]
        choices = []
        for s in samples:
            choice = {"index": s.index, "finish_reason": FINISH_REASONS.get(s.finish_reason, s.finish_reason)}
            if chat:
                choice["message"] = {"role": "assistant", "content": s.text}
                choice["logprobs"] = chat_logprobs(s.logprobs) if s.logprobs else None
            else:
                choice["text"] = s.text
                choice["logprobs"] = completion_logprobs(s.logprobs) if s.logprobs else None
            choices.append(choice)
        out = sum(s.usage.completion_tokens for s in samples)
        return {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{resp.request_id}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": choices,
            "usage": usage_of(resp.usage.prompt_tokens, out, resp.usage.cached_tokens),
        }

    async def _chunks(self, first: gen_pb.GenerateResponse, rest, chat: bool, include_usage: bool):
        """The stream's events: one chunk per message (a chat's first for each sample also says the
        role), the usage last if asked, then [DONE]. An error mid-stream is an event in OpenAI's
        error shape before [DONE] (the status was sent with the first chunk)."""
        rid, created = first.request_id, int(time.time())
        base = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": self.model}  # fmt: skip
        started, offsets, prompt, out, cached = set(), {}, 0, 0, 0
        try:
            resp = first
            while resp is not None:
                i = resp.index
                finish = FINISH_REASONS.get(resp.finish_reason, resp.finish_reason) or None
                if chat:
                    delta = {"content": resp.text}
                    if i not in started:
                        started.add(i)
                        delta = {"role": "assistant"} | delta
                    choice = {"index": i, "delta": delta, "finish_reason": finish,
                              "logprobs": chat_logprobs(resp.logprobs) if resp.logprobs else None}  # fmt: skip
                else:
                    at = offsets.get(i, 0)
                    offsets[i] = at + len(resp.text)
                    lps = completion_logprobs(resp.logprobs, at) if resp.logprobs else None
                    choice = {"index": i, "text": resp.text, "finish_reason": finish, "logprobs": lps}
                if resp.finish_reason:
                    prompt, cached = resp.usage.prompt_tokens, resp.usage.cached_tokens
                    out += resp.usage.completion_tokens
                chunk = base | {"choices": [choice]}
                if include_usage:
                    chunk["usage"] = None
                yield sse(chunk)
                resp = await anext(rest, None)
            if include_usage:
                yield sse(base | {"choices": [], "usage": usage_of(prompt, out, cached)})
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - after the status went out, an error is an event
            yield sse(json.loads(error_response(e).body))
        finally:
            await rest.aclose()
        yield "data: [DONE]\n\n"


def bind(host: str, port: int, flag: str) -> socket.socket:
    """A listening socket on host:port, or one clear error naming the port and the flag."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Each connection's kernel send buffer (accepted sockets inherit it), bounded: a client that
    # reads nothing holds at most this much of its stream here, not the kernel's 4 MB autotuned
    # most, before the stream's sends wait (and slow_reader_timeout_s ends it).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} ({flag}): {e.strerror or e}") from None
    sock.listen(1024)
    sock.setblocking(False)
    return sock


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the router's own handlers drain it (process.run)
        yield


class _Protocol(H11Protocol):
    """uvicorn's h11 protocol, with a deadline for a request's headers: from the connection's start,
    and from the first byte of each request after it on a kept-alive connection. A client that
    sends a header line now and then (or nothing after its first bytes) is answered 408 and
    closed, so a few hundred of them cannot hold connections for ever."""

    header_timeout_s = 10.0
    _headers_by: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._headers_by = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def data_received(self, data: bytes) -> None:
        if self._headers_by is None and self.conn.their_state is h11.IDLE:  # a kept-alive connection's next request
            self._headers_by = self.loop.call_later(self.header_timeout_s, self._headers_late)
        super().data_received(data)
        if self._headers_by is not None and self.conn.their_state is not h11.IDLE:  # its headers are in
            self._headers_by.cancel()
            self._headers_by = None

    def connection_lost(self, exc) -> None:
        if self._headers_by is not None:
            self._headers_by.cancel()
            self._headers_by = None
        super().connection_lost(exc)

    def _headers_late(self) -> None:
        self._headers_by = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            self.transport.close()


class HttpServer:
    """uvicorn serving the API on the router's event loop."""

    def __init__(self, api: OpenAIApi, settings, tls_files=None):
        self.api = api
        self.sock = bind(settings.host, settings.http_port, "--http-port")
        self.port = self.sock.getsockname()[1]
        self.scheme = "https" if tls_files else "http"  # TLS with the stack's certificate, as on the gRPC port
        protocol = type("Protocol", (_Protocol,), {"header_timeout_s": settings.http_header_timeout_s})
        config = uvicorn.Config(
            api.app, log_level="warning", access_log=False, lifespan="off", http=protocol,
            timeout_graceful_shutdown=int(math.ceil(settings.drain_s)) + 5,
            timeout_keep_alive=settings.http_keep_alive_s, limit_concurrency=settings.http_max_connections,
            ssl_certfile=tls_files.cert if tls_files else None, ssl_keyfile=tls_files.key if tls_files else None,
        )  # fmt: skip
        self.server = _Server(config)
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))

    def stop_accepting(self) -> None:
        """/health says draining; uvicorn stops accepting and lets the calls in hand finish."""
        self.api.serving = False
        self.server.should_exit = True

    async def stopped(self) -> None:
        if self.task is not None:
            with contextlib.suppress(asyncio.CancelledError, SystemExit):
                await self.task
        self.sock.close()
