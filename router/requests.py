"""What the router keeps of the requests it streams (Active, Sent, Result), the errors and
helpers its parts share, and the constants that bound their waits."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import logging
from dataclasses import dataclass

import grpc

from splitserve.engine.params import SamplingParams
from splitserve.service.errors import (
    Cancelled,
    ServiceError,
)
from splitserve_proto.v1 import generation_pb2 as gen_pb
from splitserve_proto.v1 import worker_pb2 as w_pb

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]

log = logging.getLogger(__name__)

SERVICE = gen_pb.DESCRIPTOR.services_by_name["Generation"].full_name

# A router's lease, in heartbeats: longer than a worker's (3), because a router taken for dead
# while alive has its queued requests failed, and one found dead late costs only a late mark.
ROUTER_LEASE_HEARTBEATS = 10

# A waiting request whose hash is gone is ended after this long: a prefill worker that holds it
# puts the hash back at its next heartbeat (Redis restarted empty), a queued job is lost for good.
LOST_GRACE_HEARTBEATS = 2

# A request that finds no decode worker registered waits this long for one to (_await_registration).
REGISTER_WAIT_HEARTBEATS = 2

# A decode worker whose registry entry lapsed while this router's channel to it is up and carries
# streams stays placeable this long, while no other is registered (WorkerRegistry._kept_lapsed).
LAPSE_GRACE_HEARTBEATS = 15

# An Abort for a request id no router has seen yet (it overtook its Generate) is remembered this
# long: the request, if it comes within it, is refused CANCELLED instead of running.
EARLY_ABORT_KEEP_S = 60

# A request sent again with the request_id of one that ended unfinished runs as a new attempt
# under its own id: the request_id, this separator (not a character request ids may use) and its
# number.
ATTEMPT_SEP = "#"

# Inputs of more characters are tokenized on a thread, not on the event loop that relays every
# stream's tokens (~0.7 s a MB: a 3.6 MB prompt held every stream through the router for 2.2 s).
# Smaller ones take a few milliseconds at most and are tokenized in place, without a hand-off.
INLINE_TOKENIZE_CHARS = 4096

# A decode stream whose last event came is cancelled only if its status has not followed within this.
STATUS_WAIT_S = 2.0


@dataclass
class Result:
    """What an attempt sends of one sample, kept for a replay (_mark, _recorded): its tokens, texts
    and log probabilities, after the `start` tokens (`start_chars` characters of text) its client
    had already (resume_from); `before`: the sample had finished before this attempt (its client
    has it all, the router none of it)."""

    start: int = 0
    start_chars: int = 0
    before: bool = False
    tokens: list = dataclasses.field(default_factory=list)
    texts: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    prompt_logprobs: list = dataclasses.field(default_factory=list)
    finish_reason: str = ""
    completion_tokens: int = 0

    def add(self, ev) -> None:
        self.tokens.extend(ev.token_ids)
        self.texts.append(ev.text)
        self.logprobs.extend(ev.logprobs)
        self.prompt_logprobs.extend(ev.prompt_logprobs)
        if ev.finish_reason:
            self.finish_reason, self.completion_tokens = ev.finish_reason, ev.completion_tokens

    def message(self, index: int) -> gen_pb.GenerateResponse:
        """As it is kept for a request of n > 1 samples: one of the choices of result_samples."""
        return gen_pb.GenerateResponse(
            index=index,
            token_ids=self.tokens,
            text="".join(self.texts),
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            finish_reason=self.finish_reason,
            usage=gen_pb.Usage(completion_tokens=self.completion_tokens),
        )


class Recorded(Exception):
    """A request_id whose latest attempt finished: its recorded result answers the call, one
    message a sample (those its client does not have all of)."""

    def __init__(self, responses: list[gen_pb.GenerateResponse]):
        super().__init__(responses[0].request_id if responses else "")
        self.responses = responses


def fingerprint(request: gen_pb.GenerateRequest) -> str:
    """What a request sent again with its request_id must match: everything but the id."""
    r = gen_pb.GenerateRequest()
    r.CopyFrom(request)
    r.request_id = ""
    r.ClearField("resume_from")  # (a stream sent again to go on is the same request)
    r.model = ""  # (one model is served: naming it or not is the same request)
    return hashlib.blake2b(r.SerializeToString(deterministic=True), digest_size=12).hexdigest()


NAME_TOKENS_INLINE = 256  # log probabilities named on the event loop; more go to a thread (_name_tokens)


def name_tokens(tokenizer, *lists) -> None:
    """Set each TokenLogprob's token, and its top_logprobs', to the token's text."""
    text = tokenizer.token_text
    for lps in lists:
        for lp in lps:
            lp.token = text(lp.token_id)
            for t in lp.top_logprobs:
                t.token = text(t.token_id)


def message_to_text(msg: gen_pb.GenerateResponse) -> str:
    """A GenerateResponse as a finished request's result is kept for its replay (a sample's log
    probabilities: result_logprobs; every sample of n > 1: result_samples): in base64 (312 bytes a
    token with the 20 most likely, measured), since the request hash is read whole and decoded as
    text (GetRequest)."""
    return base64.b64encode(msg.SerializeToString()).decode()


def message_from_text(raw: bytes) -> gen_pb.GenerateResponse:
    return gen_pb.GenerateResponse.FromString(base64.b64decode(raw))


async def cancel_once_ended(call, timeout_s: float) -> None:
    """Cancel ``call`` (a decode stream) once its status has come, or timeout_s went by without it."""
    status = asyncio.ensure_future(call.code())
    try:
        await asyncio.wait((status,), timeout=timeout_s)
    finally:
        if status.done() and not status.cancelled():
            status.exception()  # taken: an error of the call's own is not logged as an unretrieved task's
        status.cancel()
        call.cancel()  # nothing, once it has ended


def aborted_first(rid: str) -> Cancelled:
    return Cancelled(f"request {rid!r} was aborted before it arrived (Abort came first)")


class UpstreamError(ServiceError):
    """A worker ended the request with an error, and the status the client should get."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.code = code or grpc.StatusCode.INTERNAL


@dataclass
class Active:
    call: object  # the Decode call on the decode worker
    address: str  # the decode worker's
    ids: list[int]  # the prompt
    params: SamplingParams
    priority: int = 0
    cache_salt: str = ""
    local: bool = False  # its decode worker prefills it (colocated, conditional disaggregation, taken back)
    queued: bool = False  # local, in the queue's counts until its first token: this router returns them
    t_admitted: float = 0.0  # unix time
    aborted: bool = False
    first: bool = False  # its first token (or its end) came
    lost: str = ""  # why it ends without its decode worker's word (check_waiting), with lost_code
    lost_code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE
    missing_since: float = 0.0  # monotonic time check_waiting first found its hash gone (0: it is there)
    lost_seen: float = 0.0  # monotonic time check_waiting first found it failed by a handoff its worker lost
    moved: str = ""  # why check_waiting cut its stream to resume it on another worker (a handoff there broke)
    resumes: int = 0  # times it resumed on another decode worker (_resume): never taken back (take_back)
    carried: int = 0  # completion tokens its latest resume carried (prefilled again with the prompt)
    sent: int = 0  # completion tokens streamed so far, of all samples
    first_token: float = 0.0  # unix time its first token came here (0: not yet)
    recorded: int = 0  # `sent` as record_progress last wrote it


class Sent:
    """What a request's client has been sent, by sample (sampling.n): the tokens, the characters of
    their text, and which samples finished. A resumed request has them prefilled again (_resume);
    prefix affinity files sample 0's after the prompt."""

    def __init__(self, tokens: list[int], chars: int):
        self.tokens: dict[int, list[int]] = {0: list(tokens)}
        self.chars: dict[int, int] = {0: chars}
        self.finished: set[int] = set()

    def count(self) -> int:
        """The completion tokens sent, of every sample."""
        return sum(len(t) for t in self.tokens.values())

    def carried(self, n: int) -> int:
        """The completion tokens a resume prefills again after the prompt: sample 0's, or those of
        each sample not finished (n > 1, unfinished)."""
        samples = self.unfinished(n)
        return sum(len(t) for _, t, _ in samples) if samples else len(self.tokens[0])

    def add(self, ev: w_pb.DecodeEvent) -> None:
        self.tokens.setdefault(ev.index, []).extend(ev.token_ids)
        self.chars[ev.index] = self.chars.get(ev.index, 0) + len(ev.text)
        if ev.finish_reason:
            self.finished.add(ev.index)

    def unfinished(self, n: int) -> list[tuple[int, list[int], int]] | None:
        """(index, tokens, characters) of each sample not finished, for a request of n > 1 samples
        once any has tokens (the engine's resume_samples); None otherwise (it resumes as one, or
        whole)."""
        if n == 1 or not any(self.tokens.values()):
            return None
        return [(i, self.tokens.get(i, []), self.chars.get(i, 0)) for i in range(n) if i not in self.finished]


@dataclass
class RelayState:
    """One Generate call on its way through the relay (Relay._events): what _plan validated and
    placed, the decode stream and its span, and how far the request has come. Active is the part
    other tasks of the router see (the drain, take-back, check_waiting); this is the call's own."""

    request: gen_pb.GenerateRequest
    rs: object  # the call's span (tracing.rpc_span)
    t_recv: float  # unix time the call came
    tenant: object = None  # its caller's tenants.Tenant (None: the public API has no tenants)
    adm: object = None  # the admission span, until the request is admitted
    # validated and placed (_plan)
    rid: str = ""  # the request's id in Redis and at the workers: an attempt's (request_id#n) if a new one
    public_id: str = ""  # the request_id its client knows
    ids: list[int] = dataclasses.field(default_factory=list)  # the prompt
    params: SamplingParams | None = None
    have: Sent | None = None  # what its client has already (resume_from)
    carried: list[int] = dataclasses.field(default_factory=list)  # a one-sample request's tokens sent
    carried_chars: int = 0
    samples: list = dataclasses.field(default_factory=list)  # n > 1: each unfinished sample's (index, tokens, chars)
    resumed: int = 0  # completion tokens its client has, of all samples
    work: int = 0  # tokens the queue counts for it
    attempt: object = None  # redis_scripts.Attempt for a client-chosen id
    frac: float = 1.0  # the share of the queue's bounds its priority may fill
    remaining: float | None = None  # the call's time left as it came (None: no deadline)
    deadline: float = 0.0  # unix time (0: none)
    hashes: list[int] | None = None  # its prompt's block hashes, for affinity
    worker: object = None  # its decode worker (WorkerInfo)
    placed: object = None  # its placement there (Placement), until given back
    expect_cached: int = 0  # prompt tokens expected in its decode worker's prefix cache
    local: bool = False  # prefilled by its decode worker
    directed: list = dataclasses.field(default_factory=list)  # [prefill worker, tokens it holds] or []
    # the decode stream
    call: object = None
    dec: object = None  # the Decode call's span (tracing.rpc_span); None between legs
    close_seq: int = 0  # from the stream's last event
    unaccepted: object = None  # what came instead of the worker's acceptance (_accepted)
    # how far it has come
    state: str = "failed"  # how it ends if it ends now ("" once refused: nothing to record)
    failure: str = ""  # the decode worker's message, when its stream ends with an error
    queued: bool = False  # in the queue's counts until admitted as active (then active.queued)
    # the tokens it adds to the router's admitting count until its admission answers (None: not counted)
    admitting: int | None = None
    active: Active | None = None
    t_admitted: float = 0.0
    sent_by: dict[int, int] = dataclasses.field(default_factory=dict)  # a sample's index -> its tokens so far
    sent: int = 0  # completion tokens streamed so far (of all samples)
    cached: int = 0  # prompt tokens found in a prefix cache, as the first token's event said
    results: dict[int, Result] | None = None  # kept for a replay (_attempt)
    marked: bool = False  # the end recorded (_mark) already
    first_token: float = 0.0  # unix time its first token came here: recorded with its end (GetRequest)
    final: object = None  # its last event
    token_at: dict[int, float] = dataclasses.field(default_factory=dict)  # a sample's last tokens' monotonic time

    def cancelled_event(self) -> w_pb.DecodeEvent:
        return w_pb.DecodeEvent(finish_reason="cancelled", completion_tokens=self.sent, cached_tokens=self.cached)
