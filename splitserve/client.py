"""Python client for splitserve's Generation service, sync and asyncio.

    from splitserve.client import Client
    with Client("127.0.0.1:50051") as c:
        for chunk in c.generate_stream("Hello", max_tokens=32):
            print(chunk.text, end="", flush=True)

``retries=N`` (N <= 4) lets gRPC retry Generate and GenerateStream refused with
RESOURCE_EXHAUSTED (the queue is full; nothing was queued) or UNAVAILABLE, before any
response message, waiting as long as the router's ``grpc-retry-pushback-ms`` hint says. gRPC
keeps at most 256 KB of a call to send again: a larger request message is sent once, so one too
large for the router to read (RESOURCE_EXHAUSTED from gRPC) is not retried.

The address is any gRPC target. With ``balance=True``, calls are spread round robin over every
address it names or resolves to: ``ipv4:10.0.0.5:50051,10.0.0.6:50051``, or the DNS name of a
Kubernetes headless Service (``dns:///splitserve-router-headless.splitserve.svc.cluster.local:50051``),
whose ready routers it resolves to. A router that stops (SIGTERM, a rolling update) finishes
its calls and gets no new ones: gRPC sends them to the others, and a router that went away is
tried again at most 2 s apart. (Through a Service's one cluster IP, a channel's one connection
keeps every call on one router.) Without it (gRPC's pick_first), a channel uses one address at
a time, and connects again at its next call after the router restarts; balanced, a lone router
that restarts takes calls again only at the next try, up to 2 s later (calls meanwhile fail
UNAVAILABLE), so balance over several routers only.

``generate_stream(..., resumes=N)`` (and ``generate(..., resumes=N)``, which then streams and
returns what ``collect`` makes of the messages) goes on with a stream whose router was lost after
tokens came (UNAVAILABLE: it was stopped past its drain time, killed, or stopped answering): it sends
the request again with the tokens it has (``resume_from``), at most N times, and the stream goes
on unbroken, the router sending only what is new (greedy or seeded, what an unbroken stream would
have been). With ``n`` > 1, each sample's tokens go (``resume_from.samples``), and those not
finished go on, each its own. With a ``request_id``, the re-send is a new attempt of it, which
supersedes the earlier one still running for the lost router; if that one finished, the re-send
gets what the client does not have of its kept result (a replay). A re-send refused ALREADY_EXISTS
(it raced another) is tried again every 0.5 s for up to a minute, within the call's timeout (not
one refused because the request finished: its result was not kept, too long); so
is a re-send that failed UNAVAILABLE before any message (round robin sent it to the lost router
before the channel saw it go, or no router could take it), first 50 ms later, then at most
0.5 s apart, and it does not count as a resume.

``keepalive_s`` (default 30; 0 turns it off) pings the router while a call is open and the
connection has been quiet that long. A router that stops answering (its host gone, a
partition, a hung process) fails the open calls with UNAVAILABLE after about two such
intervals, instead of leaving them waiting for their deadlines, or forever without one.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import AsyncIterator, Iterable, Iterator

import grpc

from splitserve.wire import joined, keepalive_options
from splitserve_proto.v1 import generation_pb2 as pb
from splitserve_proto.v1 import generation_pb2_grpc

_OPTIONS = [("grpc.max_receive_message_length", 64 << 20)]
# Round robin over the target's addresses; an address that went away is tried again at most 2 s apart
# (gRPC's default backoff grows to 120 s), so a restarted router soon takes its share again.
_BALANCE = [
    ("grpc.lb_policy_name", "round_robin"),
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
MAX_RETRIES = 4  # gRPC makes at most 5 attempts
KEEPALIVE_S = 30.0


def channel_options(retries: int = 0, keepalive_s: float = KEEPALIVE_S, balance: bool = False) -> list[tuple]:
    """Channel options: keepalive pings on open calls unless keepalive_s is 0; with retries, a
    retry policy for the two Generate methods; with balance, round robin over the target's addresses."""
    if not 0 <= retries <= MAX_RETRIES:
        raise ValueError(f"retries must be in 0..{MAX_RETRIES}, got {retries}")
    options = [*_OPTIONS, *keepalive_options(keepalive_s), *(_BALANCE if balance else ())]
    if not retries:
        return options
    service = pb.DESCRIPTOR.services_by_name["Generation"].full_name
    config = {
        "methodConfig": [
            {
                "name": [{"service": service, "method": m} for m in ("Generate", "GenerateStream")],
                "retryPolicy": {
                    "maxAttempts": retries + 1,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "5s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["RESOURCE_EXHAUSTED", "UNAVAILABLE"],
                },
            }
        ]
    }
    return [*options, ("grpc.enable_retries", 1), ("grpc.service_config", json.dumps(config))]


def _trace_metadata() -> tuple:
    """The caller's current trace context, if it has one: the request joins the caller's trace.
    Without OpenTelemetry installed (a client-only install), none."""
    try:
        from opentelemetry import propagate
    except ImportError:
        return ()
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items())


def structured_output_pb(fmt: dict | pb.StructuredOutput) -> pb.StructuredOutput:
    """SamplingParams.structured_output from one of {"json_schema": a schema (a dict, or its JSON
    text)}, {"json_object": True}, {"regex": str}, {"choice": [str, ...]}, {"lark": str}; with
    "disable_any_whitespace": True beside a JSON one for JSON without whitespace."""
    if isinstance(fmt, pb.StructuredOutput):
        return fmt
    fmt = dict(fmt) if isinstance(fmt, dict) else fmt
    compact = bool(fmt.pop("disable_any_whitespace", False)) if isinstance(fmt, dict) else False
    if not (isinstance(fmt, dict) and len(fmt) == 1):
        raise ValueError(f"structured_output: one of json_schema, json_object, regex, choice or lark, got {fmt!r}")
    ((kind, value),) = fmt.items()
    if kind == "json_schema" and not isinstance(value, str):
        value = json.dumps(value)
    if kind == "choice":
        return pb.StructuredOutput(choice=pb.Choice(values=list(value)), disable_any_whitespace=compact)
    return pb.StructuredOutput(**{kind: value}, disable_any_whitespace=compact)


def tokenize_request(prompt: str | None = None, messages: list[dict] | None = None) -> pb.TokenizeRequest:
    req = pb.TokenizeRequest()
    if prompt is not None:
        req.prompt = prompt
    elif messages is not None:
        req.messages.CopyFrom(_chat(messages))
    return req


def _chat(messages: list[dict]) -> pb.Messages:
    return pb.Messages(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages])


def detokenize_request(token_ids: list[int], skip_special_tokens: bool | None = None) -> pb.DetokenizeRequest:
    req = pb.DetokenizeRequest(token_ids=token_ids)
    if skip_special_tokens is not None:
        req.skip_special_tokens = skip_special_tokens
    return req


def build_request(
    prompt: str | None = None,
    *,
    messages: list[dict] | None = None,
    token_ids: list[int] | None = None,
    request_id: str = "",
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    min_tokens: int = 0,
    ignore_eos: bool = False,
    include_stop_str_in_output: bool = False,
    truncate_prompt_tokens: int | None = None,
    skip_special_tokens: bool | None = None,
    n: int | None = None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    repetition_penalty: float | None = None,
    min_p: float | None = None,
    logit_bias: dict[int, float] | None = None,
    structured_output: dict | pb.StructuredOutput | None = None,
    priority: int = 0,
    cache_salt: str = "",
    resume_from: tuple[list[int], int] | pb.Continuation | None = None,
    model: str = "",
) -> pb.GenerateRequest:
    """resume_from: (the completion's tokens the client has, the characters of their text), or a
    Continuation (n > 1: its samples): a stream cut off, sent again to go on where it stopped
    (GenerateRequest.resume_from)."""
    req = pb.GenerateRequest(request_id=request_id, priority=priority, cache_salt=cache_salt, model=model)
    if prompt is not None:
        req.prompt = prompt
    elif messages is not None:
        req.messages.CopyFrom(_chat(messages))
    elif token_ids is not None:
        req.token_ids.ids.extend(token_ids)
    sp = req.sampling
    for name, value in (
        ("max_tokens", max_tokens),
        ("temperature", temperature),
        ("top_p", top_p),
        ("top_k", top_k),
        ("seed", seed),
        ("logprobs", logprobs),
        ("prompt_logprobs", prompt_logprobs),
        ("presence_penalty", presence_penalty),
        ("frequency_penalty", frequency_penalty),
        ("repetition_penalty", repetition_penalty),
        ("min_p", min_p),
        ("truncate_prompt_tokens", truncate_prompt_tokens),
        ("skip_special_tokens", skip_special_tokens),
        ("n", n),
    ):
        if value is not None:
            setattr(sp, name, value)
    sp.logit_bias.update(logit_bias or {})
    if structured_output is not None:
        sp.structured_output.CopyFrom(structured_output_pb(structured_output))
    sp.stop.extend(stop or [])
    sp.stop_token_ids.extend(stop_token_ids or [])
    sp.min_tokens = min_tokens
    sp.ignore_eos = ignore_eos
    sp.include_stop_str_in_output = include_stop_str_in_output
    if isinstance(resume_from, pb.Continuation):
        req.resume_from.CopyFrom(resume_from)
    elif resume_from is not None:
        req.resume_from.token_ids.extend(resume_from[0])
        req.resume_from.text_chars = resume_from[1]
    return req


def collect(chunks: Iterable[pb.GenerateResponse], n: int = 1) -> pb.GenerateResponse:
    """A stream's messages as Generate's one response: each sample's tokens, text and log
    probabilities joined, with the finish_reason, usage and timings of its last message; with n
    > 1 samples, sample 0's in the fields and every sample, in order, in choices."""
    samples: dict[int, pb.GenerateResponse] = {}
    texts: dict[int, list[str]] = {}
    for ch in chunks:
        if ch.index not in samples:
            samples[ch.index] = pb.GenerateResponse(request_id=ch.request_id, index=ch.index, replayed=ch.replayed)
            texts[ch.index] = []
        s = samples[ch.index]
        s.token_ids.extend(ch.token_ids)
        s.logprobs.extend(ch.logprobs)
        s.prompt_logprobs.extend(ch.prompt_logprobs)
        texts[ch.index].append(ch.text)
        if ch.finish_reason:
            s.finish_reason = ch.finish_reason
            s.usage.CopyFrom(ch.usage)
            s.timings.CopyFrom(ch.timings)
    for i, s in samples.items():
        s.text = "".join(texts[i])
    return joined(samples, n)


RESEND_WAIT_S = 0.5  # a resumed stream's re-send refused ALREADY_EXISTS: tried again this often ...
RESEND_FOR_S = 60.0  # ... for at most this long (since the cut)
RESEND_RETRY_S = 0.05  # a re-send that did not reach a router (UNAVAILABLE, nothing came): the first wait, doubled up
# to RESEND_WAIT_S (the channel may not have seen the lost router go: round robin picked it again)


class _Resumer:
    """A stream sent again to go on after its router was lost (generate_stream's resumes): what its
    client has, and whether and when to send it again."""

    def __init__(self, prompt: str | None, timeout: float | None, resumes: int, kw: dict):
        if resumes < 0:
            raise ValueError(f"resumes must be >= 0, got {resumes}")
        self.prompt, self.kw, self.left, self.resumes = prompt, kw, resumes, resumes
        self.n = kw.get("n") or 1
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.tokens: dict[int, list[int]] = {}  # by sample (index)
        self.chars: dict[int, int] = {}
        self.finished: set[int] = set()
        self.resent_at = 0.0  # monotonic time of the latest resume (0: none, or a message came since)
        self.retry_wait = RESEND_RETRY_S  # before the next re-send of that resume that met no router

    def request(self) -> pb.GenerateRequest:
        req = build_request(self.prompt, **self.kw)
        if self.n == 1 and self.has_tokens():
            req.resume_from.token_ids.extend(self.tokens[0])
            req.resume_from.text_chars = self.chars[0]
        elif self.has_tokens():
            req.resume_from.samples.extend(
                pb.SampleContinuation(index=i, token_ids=t, text_chars=self.chars[i], finished=i in self.finished)
                for i, t in sorted(self.tokens.items())
            )
        return req

    def has_tokens(self) -> bool:
        return any(self.tokens.values())

    def complete(self) -> bool:
        """Every sample's last message came (a cut after it loses nothing)."""
        return self.resumes > 0 and len(self.finished) == self.n

    def timeout(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def got(self, resp: pb.GenerateResponse) -> None:
        self.tokens.setdefault(resp.index, []).extend(resp.token_ids)
        self.chars[resp.index] = self.chars.get(resp.index, 0) + len(resp.text)
        if resp.finish_reason:
            self.finished.add(resp.index)
        self.resent_at = 0.0
        self.retry_wait = RESEND_RETRY_S

    def wait_before_resend(self, e: grpc.RpcError) -> float | None:
        """The seconds to wait before sending the request again after its call failed with e; None:
        it is not sent again (e is the caller's)."""
        now = time.monotonic()
        if self.deadline is not None and now >= self.deadline:
            return None
        if e.code() == grpc.StatusCode.UNAVAILABLE and self.has_tokens() and self.resent_at:
            # the re-send itself failed before any message: it went to the lost router (the channel
            # had not yet seen it go), or none could take it. Sent again, not counted as a resume.
            if now - self.resent_at >= RESEND_FOR_S:
                return None
            wait, self.retry_wait = self.retry_wait, min(2 * self.retry_wait, RESEND_WAIT_S)
            return wait
        if e.code() == grpc.StatusCode.UNAVAILABLE and self.has_tokens() and self.left > 0:
            self.left -= 1
            self.resent_at = now
            return 0.0
        if (
            e.code() == grpc.StatusCode.ALREADY_EXISTS
            and self.resent_at
            and now - self.resent_at < RESEND_FOR_S
            and "finished" not in (e.details() or "")
        ):
            # it raced another attempt (or met a router that does not supersede); one that finished
            # (and whose result was not kept, or does not go on from these tokens) stays so
            return RESEND_WAIT_S
        return None


class SplitserveError(grpc.aio.AioRpcError):
    """A failed call, as the service described it: code() and details() as gRPC's own error, and
    what google.rpc's details say: ``reason`` (ErrorInfo, a stable name such as QUEUE_FULL or
    MODEL_NOT_FOUND), ``field_violations`` (BadRequest: (field, description) pairs) and
    ``retry_after_s`` (RetryInfo; None without one). A subclass per status, so a caller may catch
    ``ResourceExhausted`` or ``InvalidArgument`` alone; every one is a grpc.RpcError (and an
    AioRpcError), as the client's errors have always been."""

    reason: str = ""
    field_violations: list[tuple[str, str]]
    retry_after_s: float | None = None


class InvalidArgument(SplitserveError):
    pass


class NotFound(SplitserveError):
    pass


class AlreadyExists(SplitserveError):
    pass


class ResourceExhausted(SplitserveError):
    pass


class FailedPrecondition(SplitserveError):
    pass


class Unavailable(SplitserveError):
    pass


class DeadlineExceeded(SplitserveError):
    pass


class Cancelled(SplitserveError):
    pass


class Internal(SplitserveError):
    pass


class Unauthenticated(SplitserveError):
    pass


class PermissionDenied(SplitserveError):
    pass


_TYPED = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.INTERNAL: Internal,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
}


def _debug_error_string(e: grpc.RpcError) -> str | None:
    """e's debug string. A streaming call that gRPC ended itself (cancel(), a response it could not
    decode) never gets one, and its debug_error_string() would wait for it forever; its state says
    whether there is one (read the same way for every call that keeps it)."""
    state = getattr(e, "_state", None)
    if state is None or not hasattr(state, "debug_error_string"):
        return e.debug_error_string() if hasattr(e, "debug_error_string") else None
    debug = state.debug_error_string
    return debug.decode(errors="replace") if isinstance(debug, bytes) else debug


def typed_error(e: grpc.RpcError) -> grpc.RpcError:
    """e as the SplitserveError of its status, with its google.rpc details read; e itself when it
    is one already, or not a call's error."""
    if isinstance(e, SplitserveError) or not hasattr(e, "code"):
        return e
    from google.rpc import error_details_pb2, status_pb2

    trailing = list(e.trailing_metadata() or ())
    initial = list(e.initial_metadata() or ()) if hasattr(e, "initial_metadata") else []
    debug = _debug_error_string(e)
    cls = _TYPED.get(e.code(), SplitserveError)
    out = cls(e.code(), grpc.aio.Metadata(*initial), grpc.aio.Metadata(*trailing), e.details(), debug)
    out.field_violations = []
    raw = next((v for k, v in trailing if k == "grpc-status-details-bin"), None)
    if raw:
        status = status_pb2.Status.FromString(raw)
        for any_ in status.details:
            if any_.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                any_.Unpack(info)
                out.reason = info.reason
            elif any_.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad = error_details_pb2.BadRequest()
                any_.Unpack(bad)
                out.field_violations = [(v.field, v.description) for v in bad.field_violations]
            elif any_.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                retry = error_details_pb2.RetryInfo()
                any_.Unpack(retry)
                out.retry_after_s = retry.retry_delay.seconds + retry.retry_delay.nanos / 1e9
    return out


class _TypedStream:
    """A streaming call whose failure is raised as a SplitserveError; everything else is the
    call's own (cancel(), code(), initial_metadata(), ...)."""

    def __init__(self, call):
        self._call = call

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._call)
        except grpc.RpcError as e:
            raise typed_error(e) from None

    def __getattr__(self, name):
        return getattr(self._call, name)


def _typed(fn):
    """A client method whose call's failure is raised as a SplitserveError."""

    @functools.wraps(fn)
    def call(*args, **kw):
        try:
            return fn(*args, **kw)
        except grpc.RpcError as e:
            raise typed_error(e) from None

    return call


def _typed_async(fn):
    @functools.wraps(fn)
    async def call(*args, **kw):
        try:
            return await fn(*args, **kw)
        except grpc.RpcError as e:
            raise typed_error(e) from None

    return call


def _channel(api, address: str, options: list, tls_ca: str | None):
    """api.*_channel (api: grpc or grpc.aio): TLS trusting the CA certificate(s) in the PEM file
    tls_ca ("": the system's roots), plaintext for None."""
    if tls_ca is None:
        return api.insecure_channel(address, options=options)
    roots = None
    if tls_ca:
        with open(tls_ca, "rb") as f:
            roots = f.read()
    return api.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=roots), options=options)


class _WithToken:
    """A stub whose every call carries ``authorization: Bearer <token>`` (a router with tenants)."""

    def __init__(self, stub, token: str):
        self._stub, self._auth = stub, (("authorization", f"Bearer {token}"),)

    def __getattr__(self, name: str):
        method = getattr(self._stub, name)

        def call(request, **kw):
            kw["metadata"] = (*(kw.get("metadata") or ()), *self._auth)
            return method(request, **kw)

        return call


def _stub(channel, token: str | None):
    stub = generation_pb2_grpc.GenerationStub(channel)
    return _WithToken(stub, token) if token else stub


class Client:
    def __init__(
        self,
        address: str,
        retries: int = 0,
        keepalive_s: float = KEEPALIVE_S,
        balance: bool = False,
        tls_ca: str | None = None,
        token: str | None = None,
    ):
        """tls_ca: a router serving TLS, whose certificate this PEM CA file signs ("": one of the
        system's roots); None: plaintext. token: the bearer token of a tenant (a router with
        SPLITSERVE_AUTH_TOKENS_FILE), sent on every call; None: none."""
        self.channel = _channel(grpc, address, channel_options(retries, keepalive_s, balance), tls_ca)
        self.stub = _stub(self.channel, token)

    def generate(
        self, prompt: str | None = None, *, timeout: float | None = None, resumes: int = 0, **kw
    ) -> pb.GenerateResponse:
        """resumes: streamed, going on after the router was lost at most this many times (see the
        module's doc), and collected into Generate's one response (collect)."""
        try:
            if resumes:
                return collect(self._resumed_stream(_Resumer(prompt, timeout, resumes, kw)), kw.get("n") or 1)
            return self.stub.Generate(build_request(prompt, **kw), timeout=timeout, metadata=_trace_metadata())
        except grpc.RpcError as e:
            raise typed_error(e) from None

    def generate_stream(
        self, prompt: str | None = None, *, timeout: float | None = None, resumes: int = 0, **kw
    ) -> Iterator[pb.GenerateResponse]:
        """resumes: go on after the router was lost at most this many times (see the module's doc)."""
        if not resumes:
            call = self.stub.GenerateStream(build_request(prompt, **kw), timeout=timeout, metadata=_trace_metadata())
            return _TypedStream(call)
        return self._resumed_stream(_Resumer(prompt, timeout, resumes, kw))

    def _resumed_stream(self, r: _Resumer) -> Iterator[pb.GenerateResponse]:
        while True:
            call = self.stub.GenerateStream(r.request(), timeout=r.timeout(), metadata=_trace_metadata())
            try:
                for resp in call:
                    r.got(resp)
                    yield resp
                return
            except grpc.RpcError as e:
                if r.complete():
                    return
                wait = r.wait_before_resend(e)
                if wait is None:
                    raise typed_error(e) from None
            finally:
                call.cancel()
            time.sleep(wait)

    @_typed
    def tokenize(
        self, prompt: str | None = None, *, messages: list[dict] | None = None, timeout: float | None = None
    ) -> pb.TokenizeResponse:
        return self.stub.Tokenize(tokenize_request(prompt, messages), timeout=timeout)

    @_typed
    def detokenize(
        self, token_ids: list[int], *, skip_special_tokens: bool | None = None, timeout: float | None = None
    ) -> pb.DetokenizeResponse:
        return self.stub.Detokenize(detokenize_request(token_ids, skip_special_tokens), timeout=timeout)

    @_typed
    def abort(self, request_id: str) -> pb.AbortResponse:
        return self.stub.Abort(pb.AbortRequest(request_id=request_id))

    @_typed
    def get_request(self, request_id: str, *, timeout: float | None = None) -> pb.RequestInfo:
        return self.stub.GetRequest(pb.GetRequestRequest(request_id=request_id), timeout=timeout)

    @_typed
    def list_models(self, *, timeout: float | None = None) -> list[pb.ModelInfo]:
        return list(self.stub.ListModels(pb.ListModelsRequest(), timeout=timeout).models)

    @_typed
    def get_model_info(self, name: str = "", *, timeout: float | None = None) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(name=name), timeout=timeout)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    def __init__(
        self,
        address: str,
        retries: int = 0,
        keepalive_s: float = KEEPALIVE_S,
        balance: bool = False,
        tls_ca: str | None = None,
        token: str | None = None,
    ):
        """tls_ca, token: as Client's."""
        self.channel = _channel(grpc.aio, address, channel_options(retries, keepalive_s, balance), tls_ca)
        self.stub = _stub(self.channel, token)

    async def generate(
        self, prompt: str | None = None, *, timeout: float | None = None, resumes: int = 0, **kw
    ) -> pb.GenerateResponse:
        """resumes: as Client.generate's."""
        if resumes:
            return collect(
                [ch async for ch in self.generate_stream(prompt, timeout=timeout, resumes=resumes, **kw)],
                kw.get("n") or 1,
            )
        try:
            return await self.stub.Generate(build_request(prompt, **kw), timeout=timeout, metadata=_trace_metadata())
        except grpc.RpcError as e:
            raise typed_error(e) from None

    async def generate_stream(
        self, prompt: str | None = None, *, timeout: float | None = None, resumes: int = 0, **kw
    ) -> AsyncIterator[pb.GenerateResponse]:
        """resumes: go on after the router was lost at most this many times (see the module's doc)."""
        r = _Resumer(prompt, timeout, resumes, kw)
        while True:
            call = self.stub.GenerateStream(
                r.request(), timeout=r.timeout() if resumes else timeout, metadata=_trace_metadata()
            )
            try:
                async for resp in call:
                    r.got(resp)
                    yield resp
                return
            except grpc.RpcError as e:
                if r.complete():
                    return
                wait = r.wait_before_resend(e)
                if wait is None:
                    raise typed_error(e) from None
            finally:  # left early (break, an exception, the task cancelled): the request is cancelled too
                call.cancel()
            await asyncio.sleep(wait)

    @_typed_async
    async def tokenize(
        self, prompt: str | None = None, *, messages: list[dict] | None = None, timeout: float | None = None
    ) -> pb.TokenizeResponse:
        return await self.stub.Tokenize(tokenize_request(prompt, messages), timeout=timeout)

    @_typed_async
    async def detokenize(
        self, token_ids: list[int], *, skip_special_tokens: bool | None = None, timeout: float | None = None
    ) -> pb.DetokenizeResponse:
        return await self.stub.Detokenize(detokenize_request(token_ids, skip_special_tokens), timeout=timeout)

    @_typed_async
    async def abort(self, request_id: str) -> pb.AbortResponse:
        return await self.stub.Abort(pb.AbortRequest(request_id=request_id))

    @_typed_async
    async def get_request(self, request_id: str, *, timeout: float | None = None) -> pb.RequestInfo:
        return await self.stub.GetRequest(pb.GetRequestRequest(request_id=request_id), timeout=timeout)

    @_typed_async
    async def list_models(self, *, timeout: float | None = None) -> list[pb.ModelInfo]:
        return list((await self.stub.ListModels(pb.ListModelsRequest(), timeout=timeout)).models)

    @_typed_async
    async def get_model_info(self, name: str = "", *, timeout: float | None = None) -> pb.ModelInfo:
        return await self.stub.GetModelInfo(pb.GetModelInfoRequest(name=name), timeout=timeout)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
