"""The Generation service.

Per request: validate (INVALID_ARGUMENT naming the field) -> tokenize -> a cheap look
at the queue counters (fast refusal under floods) -> pick a decode worker -> open its
Decode stream -> one atomic Redis script admits, records the request and XADDs the
prefill job (or refuses: RESOURCE_EXHAUSTED with a retry hint, and the decode stream
is closed) -> relay tokens. A client that cancels, disconnects or runs out of
deadline cancels the decode stream, which stops the work downstream and frees its KV;
the request hash says "cancelled" so a prefill worker skips a job still queued.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import functools
import hashlib
import logging
import sys
import time
import uuid
from dataclasses import dataclass

import grpc
import redis.asyncio as aioredis
import redis.exceptions

from splitserve.engine.config import ModelSpec
from splitserve.engine.errors import InvalidRequestError
from splitserve.engine.loader import load_frontend
from splitserve.engine.params import SamplingParams, check_context, check_vocab
from splitserve.engine.structured import Grammars
from splitserve.observability import tracing
from splitserve.observability.metrics import RouterMetrics
from splitserve.router.placement import Placement, Placements
from splitserve.router.prefix_index import PrefixIndex
from splitserve.router.prefix_share import SharedRecord
from splitserve.service import convert, grpc_server
from splitserve.service import redis_scripts as scripts
from splitserve.service.errors import (
    REDIS_UNREACHABLE,
    AlreadyExists,
    Cancelled,
    NotFound,
    Refused,
    ServiceError,
    Unavailable,
    code_of,
    fit_details,
    status_code,
)
from splitserve.service.peers import Peers
from splitserve.service.process import Background, settled, until_answered
from splitserve.service.redis_scripts import Scripts
from splitserve.service.redis_state import (
    CALL_TIMEOUT_S,
    FINAL_STATES,
    LOCAL_FIELD,
    MAY_RUN_AGAIN,
    QUEUE_FIELDS,
    Job,
    Keys,
    WorkerInfo,
    connect,
    priority_class,
    queue_counts,
    sampling_to_dict,
)
from splitserve.service.settings import Settings
from splitserve.wire import joined
from splitserve_proto.v1 import generation_pb2 as gen_pb
from splitserve_proto.v1 import generation_pb2_grpc, worker_pb2_grpc
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


async def _cancel_once_ended(call, timeout_s: float) -> None:
    """Cancel ``call`` (a decode stream) once its status has come, or timeout_s went by without it."""
    status = asyncio.ensure_future(call.code())
    try:
        await asyncio.wait((status,), timeout=timeout_s)
    finally:
        if status.done() and not status.cancelled():
            status.exception()  # taken: an error of the call's own is not logged as an unretrieved task's
        status.cancel()
        call.cancel()  # nothing, once it has ended


def _aborted_first(rid: str) -> Cancelled:
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


class Frontend:
    """What the router knows of the model: tokenizer, vocabulary, context."""

    def __init__(self, settings: Settings):
        self.tokenizer, config, self.name = load_frontend(
            ModelSpec(path=settings.model or None, cache_dir=settings.cache_dir)
        )
        if self.tokenizer is not None:  # worked out now (~20 ms and ~0.7 s of imports), not at the first request
            self.tokenizer.max_token_chars  # noqa: B018
            if self.tokenizer.chat_template:
                try:
                    self.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
                except Exception:  # noqa: BLE001 - a template may refuse this chat; requests get its error
                    pass
        self.vocab = config.vocab_size
        self.context = config.context_length
        self.eos = config.eos_with(self.tokenizer)
        # Structured output's formats are compiled here too, so one that does not is refused before it is queued.
        self.grammars = (
            None if self.tokenizer is None else Grammars(self.tokenizer, self.vocab, self.eos, settings.max_mask_ms)
        )

    def max_request_bytes(self) -> int:
        """The largest GenerateRequest worth reading: a text the context could hold (4 bytes a
        character at most in UTF-8) and 1 MB for the rest, at least gRPC's usual 4 MB. A larger
        one (48 MB of token ids: parsing it on the event loop held every stream for 0.5 s) is
        refused before it is read. Without a bound on the characters a token covers: 64 MB."""
        chars = self.tokenizer.max_token_chars if self.tokenizer is not None else None
        if self.tokenizer is not None and not chars:
            return grpc_server.MAX_MESSAGE
        return max(4 << 20, 4 * self.context * (chars or 1) + (1 << 20))

    def check_input_size(self, req: gen_pb.GenerateRequest, truncating: bool = False) -> int:
        """How many characters of text the request's input holds (0 for token_ids); raises when the
        input can be seen not to fit the context before tokenizing it, which takes ~0.7 s a MB, or
        before reading its token ids (6M of them held every stream for 0.75 s). truncating: the
        request keeps only its last tokens (sampling.truncate_prompt_tokens), so a longer input may
        fit; the message size the router reads still bounds it (max_request_bytes). Then token ids
        count as characters (many are read on a thread)."""
        kind = req.WhichOneof("input")
        if truncating:
            return (
                len(req.token_ids.ids)
                if kind == "token_ids"
                else len(req.prompt)
                if kind == "prompt"
                else sum(len(m.content) + len(m.role) for m in req.messages.messages)
            )
        if kind == "token_ids":
            if (n := len(req.token_ids.ids)) >= self.context:
                raise InvalidRequestError(
                    "token_ids", f"is {n} tokens; the context length is {self.context}, prompt and completion together"
                )
            return 0
        if kind == "prompt":
            n = len(req.prompt)
        elif kind == "messages":
            msgs = req.messages.messages
            if len(msgs) > self.context:  # a chat template gives a message at least one token
                raise InvalidRequestError(
                    "messages", f"{len(msgs)} messages cannot fit the context length {self.context}"
                )
            n = sum(len(m.content) + len(m.role) for m in msgs)
        else:
            return 0
        most = self.context * (self.tokenizer.max_token_chars or 0) if self.tokenizer else 0
        if most and n > most:
            raise InvalidRequestError(
                kind,
                f"is {n} characters: at least {-(-n // self.tokenizer.max_token_chars)} "
                f"tokens, and the context length is {self.context}",
            )
        return n

    def prompt_ids(self, req: gen_pb.GenerateRequest) -> list[int]:
        kind, value = convert.input_of(req)
        if kind == "token_ids":
            check_vocab("token_ids", value, self.vocab)
            return value
        if self.tokenizer is None:
            raise InvalidRequestError(kind, "this model has no tokenizer; send token_ids")
        ids = self.tokenizer.encode_chat(value) if kind == "messages" else self.tokenizer.encode(value)
        if not ids:
            raise InvalidRequestError(kind, "tokenizes to nothing")
        return ids


class RouterServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, settings: Settings, frontend: Frontend, r: aioredis.Redis, metrics: RouterMetrics | None = None):
        self.s = settings
        self.front = frontend
        self.redis = r
        self.keys = Keys(settings.redis_prefix)
        self.scripts = Scripts(r)
        self.id = settings.worker_name("router")
        self.lease_s = ROUTER_LEASE_HEARTBEATS * settings.heartbeat_s
        self.clock = (0.0, 0.0)  # (Redis's TIME, time.monotonic()) at the last renewal: leases use Redis's clock
        self.renewing_since: float | None = None  # monotonic time since which renewals came every half heartbeat
        self.last_renewal = 0.0
        # Whether this router's last lease renewal (every half heartbeat) got no answer from Redis:
        # meanwhile a request's end is recorded in the background, not before its last message
        # (it would wait CALL_TIMEOUT_S), and so are the queue counts a first token returns; new
        # requests, GetRequest and Abort are refused at once (_check_redis).
        self.redis_away = False
        self.colocated = settings.mode == "colocated"
        self.workers: list[WorkerInfo] = []
        self.prefill_workers: int | None = None  # prefill workers registered (None: not read yet)
        self.unreadable: set[bytes] = set()  # registry keys told unreadable (_registry)
        self.read_from = 0.0  # monotonic time the latest registry read (finished) began
        self.refreshing = asyncio.Lock()
        self.placements = Placements()  # corrects the registry's loads for what happened since
        self.prefixes = PrefixIndex(settings.block_size)  # what each decode worker has cached, as seen here
        # ... and each prefill worker (the prompts it prefilled): a job goes to the one with most of
        # its prompt, while that one has room (prefill_affinity_jobs; admit.lua)
        self.prefill_prefixes = PrefixIndex(settings.block_size)
        self.prefill_affinity = not self.colocated and settings.prefix_caching and settings.prefill_affinity_jobs > 0
        # only continuous engines cache prefixes (a decode worker's policy is the stack's)
        self.affinity = (
            settings.prefix_caching and settings.policy == "continuous" and settings.prefix_affinity_slack >= 0
        )
        self.peers = Peers(self._open_channel)
        self.active: dict[str, Active] = {}
        self.cut = ""  # why every request is cut off (cut_off: this router is stopping), once it is
        # Generate and GenerateStream calls being handled: a drain waits for these, not only for the
        # active requests, since one still in admission is not active yet
        self.calls = 0
        self.first_parts: dict[str, gen_pb.Timings] = {}  # TTFT parts, from the first token's event
        self.queue_seen = (0, 0, 0.0)  # (requests, tokens, monotonic time) from the last admission answer
        self.local_seen = 0  # ... and of those tokens, the ones their decode workers prefill
        self.metrics = metrics or RouterMetrics()
        self.background = Background()
        # the other routers' records come in, and this one's go out (while run() runs: serve())
        self.shared = SharedRecord(
            r, self.keys.prefix_records, self.id, [self.prefixes, self.prefill_prefixes], self.metrics
        )

    # -- registry -----------------------------------------------------------------------

    async def refresh_workers(self) -> None:
        started = time.monotonic()
        found = await self._registry("decode")
        count = not self.colocated and self.s.local_prefill_without_prefill_workers
        if self.prefill_affinity or count:
            prefill = await self._registry("prefill")
            if count:  # (else None: not counted, never "none registered")
                self.prefill_workers = len(prefill)
            if self.prefill_affinity:
                self.prefill_prefixes.workers(prefill)
        self.workers = found
        self.read_from = max(self.read_from, started)
        self.placements.prune(found)
        self.prefixes.workers(found)
        await self._reconnect_restarted(found)

    async def _registry(self, role: str) -> list[WorkerInfo]:
        """The registry's entries of role's workers. One that is not an entry a worker writes (of
        another release, or a hand's; WorkerInfo.from_mapping) is left out, and told once: before,
        it failed every read of the registry, and with it each request's placement and the
        router's reaping and checks, which follow the read."""
        found = []
        async for key in self.redis.scan_iter(match=self.keys.worker_pattern(role), count=100):
            try:
                m = await self.redis.hgetall(key)
                if m:
                    found.append(WorkerInfo.from_mapping(m))
            except (ValueError, redis.ResponseError) as e:  # (ResponseError: a key of another type)
                if key not in self.unreadable:
                    log.warning("registry entry %s left out: %s", key.decode(errors="replace"), e)
                    if len(self.unreadable) >= 1024:  # (told again, after a thousand others)
                        self.unreadable.clear()
                    self.unreadable.add(key)
        return found

    async def _reconnect_restarted(self, found: list[WorkerInfo]) -> None:
        """A decode worker that registers a new run (restarted) at an address whose channel failed
        to connect gets a new channel, which connects at once: the old one retries on gRPC's
        backoff (up to 2 s apart), and until then every request placed there fails UNAVAILABLE.
        A channel connected, or connecting, may carry streams to the new run: it stays."""
        for w in found:
            peer = self.peers.cached(w.address)
            if peer is None or not w.epoch or peer.run == w.epoch:
                continue
            if peer.run and peer.channel.get_state() == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                log.info("decode worker %s at %s restarted: connecting to it anew", w.worker_id, w.address)
                self.peers.drop(w.address)
                await peer.channel.close()
            else:  # a channel connected (or connecting) to the new run, or one opened before any
                peer.run = w.epoch

    async def refresh_since(self, t: float) -> None:
        """Make sure the registry has been read since monotonic time t: one read, one at a time,
        serves every caller that came before it began."""
        async with self.refreshing:
            if self.read_from < t:
                await self.refresh_workers()

    async def _await_registration(self, deadline: float) -> None:
        """With no decode worker registered, wait up to REGISTER_WAIT_HEARTBEATS (and the request's
        deadline, unix time; 0: none) for one to register. A Redis stall longer than a worker's lease
        lapses every entry at once, and a worker writes its entry again up to a heartbeat after Redis
        answers: before, every request in that gap failed UNAVAILABLE "no decode worker is
        registered". None comes within the wait: the request fails so, a wait later."""
        until = time.monotonic() + REGISTER_WAIT_HEARTBEATS * self.s.heartbeat_s
        if deadline:
            until = min(until, time.monotonic() + deadline - time.time())
        while not self.workers and time.monotonic() < until:
            await asyncio.sleep(min(self.s.heartbeat_s / 4, max(0.0, until - time.monotonic())))
            await self.refresh_since(time.monotonic())

    def pick(
        self, need_tokens: int, hashes: list[int] | None = None, exclude: str = "", prefer: str = ""
    ) -> tuple[WorkerInfo, Placement, int]:
        """The decode worker for a request of need_tokens (prompt + max_tokens) whose prompt has the
        block hashes `hashes` (PrefixIndex.prompt_chain), its placement, and the prompt tokens it
        is expected to find in its prefix cache. The least loaded worker, unless one expected to
        hold more of the prompt has at most prefix_affinity_slack more requests open; the worker
        `prefer` (the one a stream sent again to go on was running on) whenever it can take it.
        Never the worker `exclude` (one a request was lost on)."""
        workers = [w for w in self.workers if w.worker_id != exclude]
        if not workers:
            raise Unavailable(
                "no decode worker is registered"
                + (f" but {exclude}, which was lost" if exclude else "")
                + "; retry shortly"
            )
        largest = max(w.kv_capacity_tokens for w in workers)
        if largest < need_tokens and all(w.kv_capacity_tokens for w in workers):  # 0: an older worker, unknown
            raise InvalidRequestError(
                "sampling.max_tokens",
                f"prompt + max_tokens (× sampling.n) = {need_tokens} "
                f"tokens can never fit "
                f"in a decode worker's KV cache (the largest holds {largest})",
            )

        def load(w: WorkerInfo) -> tuple:
            return (self.placements.free_kv(w) < need_tokens, self.placements.load(w))

        # A worker this router cannot connect to (killed, its registry entry not yet lapsed) gets
        # nothing while another can take the request; if none can, the request fails naming it.
        candidates = [w for w in workers if self._reachable(w)] or workers
        loads = {c.worker_id: load(c) for c in candidates}
        w = min(candidates, key=lambda c: loads[c.worker_id])
        w = next((c for c in candidates if c.worker_id == prefer and not loads[c.worker_id][0]), w)
        cached = 0
        if w.worker_id == prefer:
            cached = self.prefixes.cached_tokens(w.worker_id, hashes) if hashes and self.affinity else 0
        elif hashes and self.affinity:
            held = {c.worker_id: self.prefixes.cached_tokens(c.worker_id, hashes) for c in candidates}
            cached = held[w.worker_id]
            short, least = loads[w.worker_id]
            best = max(candidates, key=lambda c: (held[c.worker_id], -loads[c.worker_id][1]))
            short_b, load_b = loads[best.worker_id]
            if held[best.worker_id] > cached and short_b <= short and load_b <= least + self.s.prefix_affinity_slack:
                w, cached = best, held[best.worker_id]
                self.metrics.prefix_placements.inc()  # may be a refused admission's: a placement all the same
        return w, self.placements.place(w.worker_id, need_tokens), cached

    def _prefill_worker_for(self, hashes: list[int] | None, priority: int) -> list:
        """Prefill affinity: [the prefill worker expected to hold more of this prompt in its prefix cache
        than any other, those tokens], or [] (none does: every worker may take it, as one of several
        that hold a shared system prompt; fewer than two prefill workers registered, as this router
        last read: with one, its own stream would only reorder its jobs; or not normal priority: high
        and low go to their class's stream, read by every worker in its turn). Whether the job goes
        to it is admit.lua's to say: while that worker is registered and fewer than
        prefill_affinity_jobs of its jobs wait."""
        if (
            not (self.prefill_affinity and hashes)
            or priority_class(priority) != "normal"
            or len(self.prefill_prefixes.epochs) < 2
        ):
            return []
        held = sorted(
            ((self.prefill_prefixes.cached_tokens(w, hashes), w) for w in self.prefill_prefixes.blocks), reverse=True
        )
        if not held or held[0][0] == 0 or (len(held) > 1 and held[1][0] == held[0][0]):
            return []
        return [held[0][1], held[0][0]]

    def _reachable(self, w: WorkerInfo) -> bool:
        """False while this router's channel to w is in TRANSIENT_FAILURE: its last connection
        attempt failed, and gRPC keeps it so (retrying in the background) until one succeeds."""
        peer = self.peers.cached(w.address)
        return peer is None or peer.channel.get_state() != grpc.ChannelConnectivity.TRANSIENT_FAILURE

    def _open_channel(self, address: str) -> grpc.aio.Channel:
        channel = grpc_server.channel(address, self.s.keepalive_s)
        self.background.start(self._watch(channel))
        return channel

    @staticmethod
    async def _watch(channel: grpc.aio.Channel) -> None:
        """Reconnect a channel as soon as its connection drops: a worker that was killed then shows
        as TRANSIENT_FAILURE within a moment (connection refused), not at the next request placed
        there, and one that comes back (same address) is connected before it is picked."""
        state = channel.get_state()
        try:
            while state != grpc.ChannelConnectivity.SHUTDOWN:
                if state == grpc.ChannelConnectivity.IDLE:
                    state = channel.get_state(try_to_connect=True)
                await channel.wait_for_state_change(state)
                state = channel.get_state()
        except (asyncio.CancelledError, RuntimeError, ValueError):  # the channel or the loop closed
            return

    def cut_off(self, why: str) -> None:
        """End every request this router holds with UNAVAILABLE and `why` (it is stopping), and those
        still in admission as they come out of it (_cut_if_stopping)."""
        self.cut = why
        for rid, a in list(self.active.items()):
            self._cut(rid, a, why)

    @staticmethod
    def _cut(rid: str, a: Active, why: str) -> None:
        """Its current call is cancelled even if it has ended already (lost, aborted): one cut as it
        resumed on another decode worker has a new call since (_resume)."""
        if not (a.lost or a.aborted):
            a.lost, a.lost_code = why, grpc.StatusCode.UNAVAILABLE
            log.warning("request %s: %s", rid, why)
        a.call.cancel()

    def _cut_if_stopping(self, rid: str, a: Active) -> None:
        """A request admitted after its router's drain ran out (its decode worker accepted it late: a
        padded batch running, a stopped worker) is cut off at once, as those running then were: it
        ran on until gRPC's grace ended it, "Cancelling all calls", recorded cancelled. So is one
        that resumed on another decode worker meanwhile (_resume): the cut cancelled the call to
        the worker it lost, not the new one."""
        if self.cut:
            self._cut(rid, a, self.cut)

    # -- this router's lease, and the requests of routers that died ------------------------

    async def keep_alive(self) -> None:
        """Renew this router's lease in the routers set (by Redis's clock, so routers on hosts whose
        clocks differ agree) and its request set's TTL."""
        try:
            sec, usec = await self.redis.time()
            self.clock = (sec + usec / 1e6, time.monotonic())
            async with self.redis.pipeline(transaction=False) as p:
                p.zadd(self.keys.routers, {self.id: self.clock[0] + self.lease_s})
                p.expire(self.keys.router_requests(self.id), self.s.request_ttl_s)
                await p.execute()
        except BaseException as e:
            self.renewing_since = None
            self.redis_away = self.redis_away or isinstance(e, REDIS_UNREACHABLE)
            raise
        self.redis_away = False
        t = time.monotonic()
        if self.renewing_since is None or t - self.last_renewal > 2 * self.s.heartbeat_s:
            self.renewing_since = t  # renewals stalled (Redis did not answer?): so may the others' have
        self.last_renewal = t

    def redis_now(self) -> float:
        if not self.clock[1]:  # before the first renewal
            return time.time()
        return self.clock[0] + time.monotonic() - self.clock[1]

    async def reap(self, router_id: str | None = None) -> int:
        """Mark failed the requests that have not ended of every router past its lease, or (forced) of
        router_id: this router's own id at start (left by an earlier life under the same id) and at
        stop. Returns how many were marked."""
        if router_id is None:
            # Only after a whole lease of timely renewals, the last one just now: when Redis answers
            # again after an outage or a stall (or this router's loop was held up), every router's
            # lease may have run out, and the others must get the time to renew theirs.
            t = time.monotonic()
            if (
                self.renewing_since is None
                or t - self.renewing_since < self.lease_s
                or t - self.last_renewal > self.s.heartbeat_s
            ):
                return 0
            dead = [
                x.decode()
                for x in await self.redis.zrangebyscore(self.keys.routers, "-inf", self.redis_now())
                if x.decode() != self.id
            ]
        else:
            dead = [router_id]
        n = 0
        for rt in dead:
            members = await self.redis.smembers(self.keys.router_requests(rt))
            marked = await self.scripts.run(
                scripts.reap(
                    self.keys,
                    router_id=rt,
                    request_ids=[m.decode() for m in members],
                    now=self.redis_now(),
                    finished_ttl_s=self.s.finished_ttl_s,
                    force=bool(router_id),
                )
            )
            if marked and rt != self.id:
                log.warning("router %s went away: %d of its requests marked failed", rt, marked)
                self.metrics.reaped.inc(int(marked))
            elif marked:
                log.warning("%d requests left by this router's id (%s) marked failed", marked, rt)
            n += int(marked)
        return n

    async def record_progress(self) -> None:
        """Write, for the requests this router streams whose count moved since, their completion
        tokens so far and their first token's time (progress.lua): GetRequest, on any router, shows a
        running request's progress at most half a heartbeat late. One call for them all, off their
        streams' path; their ends write the last count (_mark)."""
        moved = [(rid, a, a.sent) for rid, a in self.active.items() if a.first_token and a.sent != a.recorded]
        if not moved:
            return
        await self.scripts.run(
            scripts.progress(self.keys, running=[(rid, sent, a.first_token) for rid, a, sent in moved])
        )
        for _, a, sent in moved:
            a.recorded = sent

    async def check_waiting(self) -> None:
        """End the streams still waiting for a first token whose request Redis no longer holds (it
        restarted empty: the job is gone, no prefill worker will run it) or that were reaped (this
        router missed its lease, so prefill skips them), UNAVAILABLE, and those a prefill worker
        failed, with the status it recorded (it tells the decode worker, which ends the stream,
        but that worker may be out of its reach): their clients hear now, not at their deadlines.
        A hash gone for less than LOST_GRACE_HEARTBEATS is waited for: a prefill worker already
        running the request puts it back. One its decode worker prefills (colocated, or conditional
        disaggregation) is held there, not in Redis: not checked.
        While no prefill worker is registered (local_prefill_without_prefill_workers), those still
        queued are taken back for their decode workers to prefill (take_back)."""
        waiting = [
            (rid, a) for rid, a in self.active.items() if not (a.first or a.aborted or a.lost or a.moved or a.local)
        ]
        if not waiting:
            return
        async with self.redis.pipeline(transaction=False) as p:
            for rid, _ in waiting:
                p.hmget(
                    self.keys.req(rid),
                    "t_admitted",
                    "reaped",
                    "router",
                    "state",
                    "error",
                    "code",
                    "lost_to",
                    "decode_worker",
                )
            rows = await p.execute()
        now = time.monotonic()
        restored = []
        take_back = self._without_prefill_workers()
        for (rid, a), (admitted, reaped, router, state, error, code, lost_to, worker) in zip(waiting, rows):
            if a.first or self.active.get(rid) is not a:
                continue
            if take_back and state == b"queued" and not (a.resumes or a.carried):
                await self.take_back(rid, a)
            if admitted is None:
                a.missing_since = a.missing_since or now
                if now - a.missing_since < LOST_GRACE_HEARTBEATS * self.s.heartbeat_s:
                    continue  # a prefill worker holding it puts its hash back at its next heartbeat
                a.lost = "the queue state store (Redis) no longer holds this request (it restarted empty?); retry"
            elif reaped:
                a.lost = f"this router ({self.id}) missed its lease in Redis and its requests were failed; retry"
            elif state == b"failed" and lost_to and lost_to == worker and a.resumes < self.s.decode_resumes:
                # Its prefill worker could not reach its decode worker (stopped, killed): this router's
                # own stream to it is dropped as well (keepalive), and the request resumes on another
                # (resume.lua lets it). Failed now, it would not. Past that, the stream still up (the
                # worker went on after the prefill worker gave up, or only the prefill workers are cut
                # off from it), the handoff will never come: this router cuts the stream itself and
                # the request resumes all the same (_events). Before, it failed UNAVAILABLE.
                a.lost_seen = a.lost_seen or now
                if now - a.lost_seen < 2 * self.s.keepalive_s + self.s.heartbeat_s:
                    continue
                a.moved = (error or b"its KV handoff failed").decode(errors="replace")
                log.warning("request %s: %s; this router's stream there is up: resuming it on another", rid, a.moved)
                a.call.cancel()
                continue
            elif state == b"failed":
                a.lost = (error or b"a worker failed this request").decode(errors="replace")
                got = status_code(int(code)) if code and code.isdigit() else None
                a.lost_code = got if got not in (None, grpc.StatusCode.OK) else grpc.StatusCode.UNAVAILABLE
            else:
                a.missing_since = 0.0
                if router is None:  # put back by its prefill worker: this router holds it again
                    restored.append(rid)
                continue
            log.warning("request %s: %s", rid, a.lost)
            a.call.cancel()
        if restored:  # so that they are reaped if this router dies
            async with self.redis.pipeline(transaction=False) as p:
                for rid in restored:
                    p.hset(self.keys.req(rid), "router", self.id)
                p.sadd(self.keys.router_requests(self.id), *restored)
                p.expire(self.keys.router_requests(self.id), self.s.request_ttl_s)
                await p.execute()
            if ended := [rid for rid in restored if rid not in self.active]:  # ended meanwhile (_mark removed it)
                await self.redis.srem(self.keys.router_requests(self.id), *ended)

    async def take_back(self, rid: str, a: Active) -> None:
        """Take a request that waits in the prefill queue back for its decode worker to prefill, on
        the Decode stream it has open there: no prefill worker is registered (all died, or hang),
        and without this it would wait for one to return, or for its deadline. A prefill worker
        that has picked it up keeps it (the script takes back only a request still queued), and one
        that pulls its job later skips it. It then counts as one its decode worker prefills."""
        took = await self.scripts.run(
            scripts.take_back(self.keys, request_id=rid, prompt_tokens=len(a.ids), now=time.time())
        )
        if not int(took):
            return
        if self.active.get(rid) is not a:  # it ended meanwhile, its counts not returned: they go back now
            await self._dequeue(rid, len(a.ids))
            return
        a.local = a.queued = True  # returned at its first token, or its end
        self.metrics.taken_back.inc()
        log.warning("request %s: no prefill worker is registered; its decode worker at %s prefills it", rid, a.address)
        self.background.start(self._prefill_at_decode_worker(rid, a))

    async def _prefill_at_decode_worker(self, rid: str, a: Active) -> None:
        req = w_pb.PrefillHereRequest(
            request_id=rid,
            prompt_token_ids=a.ids,
            priority=a.priority,
            sampling=convert.sampling_to_pb(a.params),
            cache_salt=a.cache_salt,
            queue_ms=(time.time() - a.t_admitted) * 1000,
        )
        try:
            await self.stub(a.address).PrefillHere(req, timeout=10.0)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND or self.active.get(rid) is not a:
                return  # its stream has ended (the client went, or its worker): nothing waits for it
            if e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED):
                a.lost_code = e.code()
            a.lost = f"no prefill worker is registered, and its decode worker could not prefill it: {e.details()}"
            log.warning("request %s: %s", rid, a.lost)
            a.call.cancel()

    def _check_redis(self) -> None:
        """While this router's last lease renewal got no answer, a call that needs Redis is refused at
        once, UNAVAILABLE naming Redis: it would wait CALL_TIMEOUT_S for its own timeout, to the same
        end. (Renewals go on every half heartbeat: the first one answered ends this.)"""
        if self.redis_away:
            raise redis.exceptions.ConnectionError(
                f"it did not answer this router's last call within {CALL_TIMEOUT_S:g} s (asked again every "
                f"{self.s.heartbeat_s / 2:g} s)"
            )

    async def _dequeue(self, rid: str, prompt_tokens: int) -> None:
        """Return the queue counts of a request its decode worker prefills (dequeue.lua: once). While
        Redis is away, in the background, until it answers (the request goes on meanwhile)."""
        await self._write(
            functools.partial(
                self.scripts.run, scripts.dequeue(self.keys, request_id=rid, prompt_tokens=prompt_tokens)
            ),
            f"{rid}'s queue counts",
        )

    async def _write(self, call, what: str, away: bool = False) -> None:
        """A Redis write (call) that the request's path does not wait for while Redis is away (`away`,
        or this router's last renewal got no answer): then, or when this call gets none, it is done
        in the background once Redis answers (until_answered). A cancel of the request's task does
        not cut it off (settled)."""
        if not (away or self.redis_away):
            try:
                await settled(call())
                return
            except REDIS_UNREACHABLE as e:
                self.redis_away = True
                log.warning("could not record %s (again once Redis answers): %s", what, e)
        self.background.start(until_answered(call, what, self.s.heartbeat_s, self.s.request_ttl_s))

    def stub(self, address: str) -> worker_pb2_grpc.DecodeWorkerStub:
        return self.peers.get(address).stub

    async def close_idle_channels(self) -> None:
        """Close the channels to decode workers that have left the registry and carry no stream."""
        keep = {w.address for w in self.workers} | {a.address for a in self.active.values()}
        for peer in self.peers.prune(keep):
            await peer.channel.close()

    # -- the request path ---------------------------------------------------------------

    async def _validate(self, request: gen_pb.GenerateRequest) -> tuple[str, list[int], SamplingParams, Sent]:
        convert.check_request_id(request.request_id)
        convert.check_cache_salt(request.cache_salt)
        params = convert.sampling_from_pb(request.sampling, self.s.default_max_tokens)
        keep = request.sampling.truncate_prompt_tokens if request.sampling.HasField("truncate_prompt_tokens") else None
        if keep is not None and keep < 1:
            raise InvalidRequestError("sampling.truncate_prompt_tokens", f"must be >= 1, got {keep}")
        if self.front.check_input_size(request, keep is not None) > INLINE_TOKENIZE_CHARS:  # beside the loop
            ids = await asyncio.to_thread(self.front.prompt_ids, request)
        else:
            ids = self.front.prompt_ids(request)
        if keep is not None:
            ids = ids[-keep:]
        check_context(len(ids), params, self.front.context, request.WhichOneof("input"))
        have = self._continuation(request, params)
        if have.count() and params.prompt_logprobs is not None:  # they came with its first token
            params = dataclasses.replace(params, prompt_logprobs=None)
        check_vocab("sampling.stop_token_ids", params.stop_token_ids, self.front.vocab)  # (as the engine does)
        check_vocab("sampling.logit_bias", (t for t, _ in params.logit_bias), self.front.vocab)
        fmt = params.structured_output
        if fmt is not None:
            if self.front.grammars is None:
                raise InvalidRequestError(fmt.field, "needs a model with a tokenizer")
            await asyncio.to_thread(self.front.grammars.check, fmt)  # ~1 ms to compile, more for a large schema
            if have.count():
                await asyncio.to_thread(self._check_follows, request.resume_from, fmt)
        return request.request_id or uuid.uuid4().hex, ids, params, have

    def _check_follows(self, c: gen_pb.Continuation, fmt) -> None:
        """The tokens a client sent again to go on (resume_from) follow the request's format, or the
        request is refused here, naming them, rather than by the worker that would prefill it."""
        carried = (
            [("resume_from.token_ids", c.token_ids)]
            if c.token_ids
            else [
                (f"resume_from.samples[{k}].token_ids", s.token_ids) for k, s in enumerate(c.samples) if not s.finished
            ]
        )
        for field, tokens in carried:
            try:
                m = self.front.grammars.matcher(fmt, tokens)
            except ValueError as e:
                raise InvalidRequestError(field, f"these tokens {e}") from None
            if c.token_ids and m.is_stopped():  # (a sample of n > 1 so ends at once: resume_samples)
                raise InvalidRequestError(
                    field, f"these tokens complete {fmt.field}, which ends the request: none is left to generate"
                )

    def _continuation(self, request: gen_pb.GenerateRequest, params: SamplingParams) -> Sent:
        """What the client of a stream sent again to go on has (resume_from), checked: the
        completion's tokens and the characters of their text, by sample (none without it)."""
        c = request.resume_from
        if params.n == 1:
            if c.samples:
                raise InvalidRequestError(
                    "resume_from.samples", "are for sampling.n > 1; with n 1, send resume_from.token_ids and text_chars"
                )
            self._check_carried("resume_from.token_ids", c.token_ids, params)
            return Sent(c.token_ids, c.text_chars)
        if c.token_ids:
            raise InvalidRequestError(
                "resume_from.token_ids", f"sampling.n is {params.n}: send each sample's in resume_from.samples"
            )
        have = Sent([], 0)
        listed = set()
        for k, sample in enumerate(c.samples):
            field = f"resume_from.samples[{k}]"
            if sample.index >= params.n:
                raise InvalidRequestError(f"{field}.index", f"{sample.index} is not below sampling.n ({params.n})")
            if sample.index in listed:
                raise InvalidRequestError(f"{field}.index", f"sample {sample.index} is listed twice")
            listed.add(sample.index)
            # One not finished may hold max_tokens: its client had its last token, not the message of
            # its end (a first token sent ahead of its KV is followed by one); resumed, it ends at once.
            if len(sample.token_ids) > params.max_tokens:
                raise InvalidRequestError(
                    f"{field}.token_ids",
                    f"{len(sample.token_ids)} tokens: more than sampling.max_tokens ({params.max_tokens})",
                )
            if not sample.finished:
                check_vocab(f"{field}.token_ids", sample.token_ids, self.front.vocab)
            have.tokens[sample.index], have.chars[sample.index] = list(sample.token_ids), sample.text_chars
            if sample.finished:
                have.finished.add(sample.index)
        if len(have.finished) == params.n:
            raise InvalidRequestError(
                "resume_from.samples", f"all {params.n} samples finished: nothing is left to generate"
            )
        return have

    def _check_carried(self, field: str, tokens, params: SamplingParams) -> None:
        if len(tokens) >= params.max_tokens:
            raise InvalidRequestError(
                field, f"{len(tokens)} tokens: sampling.max_tokens ({params.max_tokens}) leaves none to generate"
            )
        check_vocab(field, tokens, self.front.vocab)
        # Tokens that end it leave none to generate (a complete format: _check_follows): the engine
        # that took them would refuse them too, naming its own field.
        if not tokens or len(tokens) < params.min_tokens:
            return
        if tokens[-1] in params.stop_token_ids or (not params.ignore_eos and tokens[-1] in self.front.eos):
            raise InvalidRequestError(
                field,
                f"the last, {tokens[-1]}, ends the request (an end-of-sequence or "
                "stop token): none is left to generate",
            )
        if params.stop and self.front.tokenizer is not None:
            text = self.front.tokenizer.decode(list(tokens), params.skip_special_tokens)
            if hit := next((s for s in params.stop if s in text), None):
                raise InvalidRequestError(
                    field, f"their text holds the stop string {hit!r}, which ends the request: none is left to generate"
                )

    async def _attempt(self, rid: str, fp: str, have: Sent) -> tuple[str, scripts.Attempt, str]:
        """The id a request with a client-chosen request_id runs under, what admission checks of it
        (scripts.Attempt; fp: its fingerprint), and, for one sent again to go on (below), the decode worker
        its latest attempt ran on ("" otherwise). A new id runs under itself. The id of a request that
        finished answers with its recorded result (raises Recorded). One whose latest attempt ended
        unfinished (it failed, or its client went away or its deadline passed) may be sent again
        (a client's retry, gRPC's own included): it runs as a new attempt under its own id
        (request_id#n), so nothing left of the earlier one (a job still queued, a late handoff) can
        touch it. Any other that exists is refused ALREADY_EXISTS (a request never runs twice, nor
        again after an Abort, nor under the id of a different request), and one that an Abort came
        before is refused CANCELLED. have: what its client has, sent again to go on (resume_from)
        after it lost its stream with its router: then a latest attempt still running is superseded
        by the new one (admit.lua), not waited for (a dead router's would run on until reaped), and
        the replay of one that finished is only what the client does not have."""
        supersede = have.count() > 0
        first = self.keys.req(rid)
        state, early, aborted, attempts, current, fp_first, was_on = await self.redis.hmget(
            first, "state", "early", "aborted", "attempts", "current", "fingerprint", "decode_worker"
        )
        if state is None:
            return rid, scripts.Attempt(seen=0, fingerprint=fp), ""
        if early == b"1":
            raise _aborted_first(rid)
        if fp_first is not None and fp_first.decode() != fp:
            raise AlreadyExists(
                f"request_id {rid!r} belongs to a different request (its input, sampling or priority "
                "differ); send this one with a new request_id"
            )
        latest = current.decode() if current else rid
        if latest != rid:
            state, aborted, was_on = await self.redis.hmget(self.keys.req(latest), "state", "aborted", "decode_worker")
        if state == b"finished":
            if (recorded := await self._recorded(rid, latest, have)) is not None:
                raise Recorded(recorded)
            raise AlreadyExists(
                f"request_id {rid!r} already exists and finished, and its result was not kept (only "
                f"one of at most replay_max_tokens = {self.s.replay_max_tokens} tokens, n x "
                "max_tokens, is); see GetRequest"
            )
        if aborted:
            raise AlreadyExists(f"request_id {rid!r} was aborted (see GetRequest); send it with a new request_id")
        if (
            state is not None
            and state.decode() not in MAY_RUN_AGAIN
            and not (supersede and state.decode() not in FINAL_STATES)
        ):  # None: the latest's hash expired
            raise AlreadyExists(
                f"request_id {rid!r} already exists and is {state.decode()} (see GetRequest); the same "
                "request may be sent again once it has ended"
            )
        n = int(attempts or 1)
        return (
            f"{rid}{ATTEMPT_SEP}{n + 1}",
            scripts.Attempt(seen=n, fingerprint=fp, first_id=rid, latest_id=latest),
            (was_on or b"").decode() if supersede else "",
        )

    async def _recorded(self, rid: str, attempt: str, have: Sent) -> list[gen_pb.GenerateResponse] | None:
        """The result a finished attempt left in its hash (_mark), as its replay: a message for each
        sample, after the tokens its client has of it (have, resume_from: the last message did not
        reach it), none for a sample it has whole (finished); None if the attempt left none."""
        (
            tokens,
            text,
            reason,
            n_prompt,
            n_out,
            n_cached,
            logprobs,
            start,
            start_chars,
            samples,
            starts,
        ) = await self.redis.hmget(
            self.keys.req(attempt),
            "result_tokens",
            "result_text",
            "finish_reason",
            "prompt_tokens",
            "completion_tokens",
            "cached_tokens",
            "result_logprobs",
            "result_start",
            "result_start_chars",
            "result_samples",
            "result_starts",
        )
        if samples is not None:  # n > 1: each sample's, and where it started (_mark)
            kept = message_from_text(samples).choices
            begun = [tuple(int(x) for x in s.split(":")) for s in starts.decode().split(",")]
        elif tokens is None:
            return None
        else:
            kept = [
                gen_pb.GenerateResponse(
                    token_ids=[int(t) for t in tokens.split(b",") if t],
                    text=(text or b"").decode(),
                    finish_reason=(reason or b"").decode(),
                    usage=gen_pb.Usage(completion_tokens=int(n_out or 0)),
                )
            ]
            if logprobs:
                kept[0].MergeFrom(message_from_text(logprobs))  # (only log probabilities)
            begun = [(int(start or 0), int(start_chars or 0), 0)]
        out = []
        for sample, (first, first_chars, before) in zip(kept, begun):
            i = sample.index
            if before and i not in have.finished:
                raise AlreadyExists(
                    f"request_id {rid!r} already exists and finished; sample {i} had finished before "
                    "its last attempt, which went on from resume_from: only what came after was kept, "
                    "for a re-send whose resume_from.samples holds that sample finished"
                )
            if i in have.finished:
                continue
            resp = self._replay_of(rid, sample, first, first_chars, have.tokens.get(i, []), have.chars.get(i, 0))
            resp.usage.prompt_tokens, resp.usage.cached_tokens = int(n_prompt or 0), int(n_cached or 0)
            out.append(resp)
        return out

    @staticmethod
    def _replay_of(
        rid: str, kept: gen_pb.GenerateResponse, start: int, start_chars: int, carried: list[int], chars: int
    ) -> gen_pb.GenerateResponse:
        """A sample's kept result (its tokens after the `start` its attempt went on from) as the
        replay to a client that has `carried` tokens (`chars` characters) of it: what comes after."""
        if len(carried) < start:
            raise AlreadyExists(
                f"request_id {rid!r} already exists and finished, going on from {start} tokens its "
                "client had (resume_from): only what came after them was kept, for a re-send whose "
                "resume_from holds at least those"
            )
        skip, skip_chars = len(carried) - start, chars - start_chars
        if carried[start:] != list(kept.token_ids[:skip]) or not 0 <= skip_chars <= len(kept.text):
            raise AlreadyExists(
                f"request_id {rid!r} already exists and finished with other tokens than "
                "resume_from's (or fewer characters than its text_chars)"
            )
        resp = gen_pb.GenerateResponse(
            request_id=rid,
            index=kept.index,
            token_ids=kept.token_ids[skip:],
            text=kept.text[skip_chars:],
            finish_reason=kept.finish_reason,
            replayed=True,
            usage=kept.usage,
            logprobs=kept.logprobs[skip:],
        )
        if not carried:  # they came with the first token
            resp.prompt_logprobs.extend(kept.prompt_logprobs)
        return resp

    async def _latest(self, rid: str) -> str:
        """The id of a request_id's latest attempt."""
        current = await self.redis.hget(self.keys.req(rid), "current")
        return current.decode() if current else rid

    def _queue_may_be_full(self, tokens: int) -> bool:
        """False when this router saw the queue under half its refusal bound in the last 10 seconds.

        The admission script decides either way; this only spares light load the read that
        lets a flood be refused before a decode stream is opened.
        """
        q, t, when = self.queue_seen
        if time.monotonic() - when > 10.0:
            return True
        frac = self.s.admit_fraction / 2
        return q + 1 > self.s.max_queue_requests * frac or t + tokens > self.s.max_queue_tokens * frac

    def _without_prefill_workers(self) -> bool:
        """No prefill worker is registered, and local_prefill_without_prefill_workers is on (the
        registry read counts them only then; never colocated)."""
        return self.prefill_workers == 0

    def _prefill_locally(self, tokens: int, cached: int = 0) -> bool:
        """Whether the chosen decode worker prefills this prompt itself rather than a prefill worker:
        always when colocated; disaggregated (conditional disaggregation), when no prefill worker
        is registered (local_prefill_without_prefill_workers: all died, or hang), when what it
        must compute is short (local_prefill_max_tokens: the prompt's tokens less the `cached`
        ones it is expected to hold already) or when prefill workers are behind (more than
        local_prefill_queue_tokens queued for them at the last admission this router saw)."""
        if self.colocated:
            return True
        if self._without_prefill_workers():
            return True
        if tokens - cached <= self.s.local_prefill_max_tokens:
            return True
        backlog = self.queue_seen[1] - self.local_seen
        return 0 < self.s.local_prefill_queue_tokens < backlog and time.monotonic() - self.queue_seen[2] <= 10.0

    def _refusal(self, q: int, t: int, frac: float) -> Refused:
        hint = self.s.retry_after_ms
        return Refused(
            f"queue is full ({q} requests, {t} tokens queued; refusing from {frac:.0%} of "
            f"{self.s.max_queue_requests} requests / {self.s.max_queue_tokens} tokens); retry after {hint} ms",
            metadata=(("retry-after-ms", str(hint)), ("grpc-retry-pushback-ms", str(hint))),
        )

    async def _events(self, request: gen_pb.GenerateRequest, context, rs: tracing.rpc_span):
        """Yields (rid, the request_id its client knows, prompt_tokens, DecodeEvent) for every decode
        event of the request; rid differs from the client's for a new attempt (_attempt)."""
        t_recv = time.time()
        m = self.metrics
        adm = tracing.tracer().start_span("admission", context=rs.ctx)
        try:
            # have: what its client has already (resume_from: a stream sent again to go on), prefilled
            # after the prompt (sampling.n > 1: each sample not finished, by its decode worker,
            # Sent.unfinished); the queue counts them with it
            rid, ids, params, have = await self._validate(request)
            self._check_redis()
            carried, carried_chars = (have.tokens[0], have.chars[0]) if params.n == 1 else ([], 0)
            samples = have.unfinished(params.n)
            resumed = have.count()
            work = len(ids) + have.carried(params.n)
            public_id, attempt, was_on = rid, None, ""
            if request.request_id:  # client-chosen: it may exist (see _attempt)
                rid, attempt, was_on = await self._attempt(rid, fingerprint(request), have)
            rs.span.set_attributes(self._genai_attributes(request, rid, ids, params, resumed))
            # High priority (< 0) may use the headroom above admit_fraction, up to the bound itself.
            frac = 1.0 if priority_class(request.priority) == "high" else self.s.admit_fraction
            if self._queue_may_be_full(work):  # fast path: no decode stream opened for a refusal
                *counts, local = await self.redis.hmget(self.keys.admission, *QUEUE_FIELDS, LOCAL_FIELD)
                q, t = queue_counts(counts)
                self.queue_seen, self.local_seen = (q, t, time.monotonic()), int(local or 0)
                if q + 1 > int(self.s.max_queue_requests * frac) or t + work > int(self.s.max_queue_tokens * frac):
                    raise self._refusal(q, t, frac)
            remaining = context.time_remaining()
            deadline = t_recv + remaining if remaining is not None else 0.0
            if not any(self._reachable(w) for w in self.workers):
                # None registered, or none connected: a worker that has just (re)started may be
                # registered by now, and is placed at once (not after the next periodic read).
                await self.refresh_since(time.monotonic())
                if not self.workers:
                    await self._await_registration(deadline)
            hashes = (
                self.prefixes.prompt_chain(ids, request.cache_salt) if self.affinity or self.prefill_affinity else None
            )
            worker, placed, expect_cached = self.pick(
                len(ids) + params.n * params.max_tokens, hashes if self.affinity else None, prefer=was_on
            )
            if params.prompt_logprobs is not None:  # its prompt is computed whole wherever it goes
                expect_cached = 0
            # A stream sent again to go on (its router was lost) goes back to the decode worker that
            # was running it, which holds the KV of its prompt and of the tokens sent in its prefix
            # cache, and prefills only the rest itself: a prefill worker would compute the tokens
            # sent again, behind the other re-sends, and hand all of its KV over.
            going_on = bool(carried) and worker.worker_id == was_on and self.s.prefix_caching
            local = bool(samples) or going_on or self._prefill_locally(work, expect_cached)
            directed = [] if local else self._prefill_worker_for(hashes, request.priority)
            adm.set_attributes(
                {"splitserve.prefill.local": local, "splitserve.prefix.expected_cached_tokens": expect_cached}
            )
        except BaseException as e:
            self._end_admission(adm, e)
            raise
        close_seq = 0  # from the stream's last event
        dec = tracing.rpc_span(
            "splitserve.v1.DecodeWorker/Decode",
            kind=tracing.SpanKind.CLIENT,
            parent=rs.ctx,
            attributes=tracing.rpc_attributes("splitserve.v1.DecodeWorker/Decode")
            | {"server.address": worker.address, "splitserve.decode_worker": worker.worker_id},
        )
        dreq = w_pb.DecodeRequest(
            request_id=rid, prompt_tokens=len(ids), deadline_unix=deadline, priority=request.priority, leg=0
        )
        if local:  # the decode worker prefills it itself; the queue counts it until its first token
            dreq.prompt_token_ids.extend(ids + carried)
            dreq.sampling.CopyFrom(convert.sampling_to_pb(params))
            dreq.cache_salt = request.cache_salt
            dreq.resumed_tokens, dreq.resumed_chars = len(carried), carried_chars
            if samples:
                dreq.resumed_samples.extend(w_pb.ResumedSample(index=i, token_ids=t, chars=c) for i, t, c in samples)
        try:
            peer = self.peers.get(worker.address)
            peer.run = peer.run or worker.epoch  # the run a new channel was opened for (_reconnect_restarted)
            call = peer.stub.Decode(dreq, timeout=remaining, metadata=tracing.inject(dec.ctx))
        except BaseException:
            self.placements.ended(worker.worker_id, placed)
            raise
        state = "failed"
        failure = ""  # the decode worker's message, when its stream ends with an error
        queued = False
        active = None
        sent_by = {i: len(t) for i, t in have.tokens.items()}  # a sample's index -> its completion tokens so far
        sent = sum(sent_by.values())  # completion tokens streamed so far (of all samples)
        cached = 0  # prompt tokens found in a prefix cache, as the first token's event said
        # kept for a replay (_attempt), each sample's: a resumed attempt's after the tokens its client had
        results = (
            {i: Result(len(have.tokens.get(i, ())), have.chars.get(i, 0), i in have.finished) for i in range(params.n)}
            if request.request_id and params.n * params.max_tokens <= self.s.replay_max_tokens
            else None
        )
        marked = False  # the end recorded (_mark) already
        first_token = 0.0  # unix time its first token came here: recorded with its end (GetRequest)
        failed_with = None  # the exception the request ends with (the decode span in use ends with it)
        # The worker lost as the stream opened (_accepted): the request is admitted all the same, and
        # resumes on another at once, as if it was lost later (before, it failed UNAVAILABLE).
        unaccepted = None
        try:
            try:
                try:
                    if local:  # the worker starts on the prompt at once: admit once it accepted (or was lost)
                        unaccepted = await self._accepted(call, worker, placed)
                    t_admitted = time.time()
                    job = Job(
                        request_id=rid,
                        token_ids=ids + carried,
                        sampling=sampling_to_dict(params),
                        decode_worker=worker.worker_id,
                        decode_address=worker.address,
                        decode_epoch=worker.epoch,
                        decode_host_id=worker.host_id,
                        deadline_unix=deadline,
                        traceparent=tracing.traceparent_of(rs.span),
                        t_received=t_recv,
                        t_admitted=t_admitted,
                        priority=request.priority,
                        cache_salt=request.cache_salt,
                        decode_cached_tokens=expect_cached,
                        resumed=len(carried),
                        resumed_chars=carried_chars,
                    )
                    # Disaggregated, the job is queued while the stream opens: a prefill takes longer
                    # than the stream does, and the decode worker holds a handoff that comes first.
                    # Settled: cut off by a cancel while Redis runs it (a slow or stopped Redis), an
                    # admission would be done there but not here, and its counts never returned.
                    got = await settled(
                        self.scripts.run(
                            scripts.admit(
                                self.keys,
                                request_id=rid,
                                job_json=job.to_json(),
                                priority=request.priority,
                                tokens=work,
                                max_requests=self.s.max_queue_requests,
                                max_tokens=self.s.max_queue_tokens,
                                fraction=frac,
                                ttl_s=self.s.request_ttl_s,
                                queue=not local,
                                router_id=self.id,
                                attempt=attempt,
                                directed_to=directed[0] if directed else "",
                                directed_bound=self.s.prefill_affinity_jobs,
                                supersede=bool(resumed),
                            )
                        )
                    )
                    ok, q, t, lt = (int(x) for x in got[:4])
                    if len(got) > 4 and int(got[4]):
                        self.metrics.prefill_directed.inc()
                        adm.set_attributes(
                            {
                                "splitserve.prefill.sent_to": directed[0],
                                "splitserve.prefix.expected_prefill_cached_tokens": directed[1],
                            }
                        )
                    queued = local and ok == 1
                    self.queue_seen, self.local_seen = (q, t, time.monotonic()), lt
                    adm.set_attributes(
                        {"splitserve.queue.requests": q, "splitserve.queue.tokens": t, "splitserve.admitted": ok == 1}
                    )
                    if ok == -1:
                        state = ""
                        raise AlreadyExists(f"request_id {public_id!r} already exists (see GetRequest)")
                    if ok == -2:
                        state = ""
                        raise _aborted_first(public_id)
                    if ok == 0:
                        state = ""
                        raise self._refusal(q, t, frac)
                    if not local:  # refused now: the job is marked failed (finally), so no worker runs it
                        unaccepted = await self._accepted(call, worker, placed)
                except BaseException as e:
                    if isinstance(e, asyncio.CancelledError) and state:
                        state = "cancelled"
                    self._end_admission(adm, e)
                    raise
                adm.end()
                m.prompt_tokens.inc(len(ids))
                if local:
                    m.local_prefills.inc()
                if params.structured_output is not None:
                    m.structured.labels(params.structured_output.kind).inc()
                active = self.active[rid] = Active(
                    call,
                    worker.address,
                    ids,
                    params,
                    request.priority,
                    request.cache_salt,
                    local,
                    queued,
                    t_admitted,
                    carried=resumed,
                    sent=sent,
                )
                self._cut_if_stopping(rid, active)
                queued = False  # the active request's now (active.queued): a take-back sets it too
                final = None
                try:
                    while True:
                        try:
                            if unaccepted is not None:
                                ev, unaccepted = unaccepted, None
                                if isinstance(ev, grpc.aio.AioRpcError):
                                    raise ev
                            else:
                                ev = await call.read()
                            lost = (
                                "decode stream ended without a finish"
                                if ev is grpc.aio.EOF
                                else ev.error
                                if ev.error and ev.worker_stopping
                                else ""
                            )
                        except grpc.aio.AioRpcError as e:
                            if e.code() != grpc.StatusCode.UNAVAILABLE:
                                raise
                            ev, lost = e, f"{e.code().name}: {e.details()}"
                        except asyncio.CancelledError:  # the call, cut by check_waiting; or this task, cancelled
                            if not active.moved or active.aborted or asyncio.current_task().cancelling():
                                raise
                            ev, lost = None, active.moved
                        if lost and active.resumes < self.s.decode_resumes and not (active.lost or active.aborted):
                            # Its decode worker was lost: it goes on on another (_resume).
                            if active.queued:  # prefilled there: its queue counts go back now (a new leg counts anew)
                                active.queued = False
                                await self._dequeue(rid, work)
                            self.placements.ended(
                                worker.worker_id, placed, getattr(ev, "close_seq", 0) or close_seq, len(ids) + sent
                            )
                            close_seq, placed = 0, None
                            dec.__exit__(Unavailable, Unavailable(lost), None)
                            dec = None
                            call.cancel()
                            old = worker
                            active.moved, active.lost_seen = "", 0.0
                            call, worker, placed, dec = await self._resume(
                                rid, active, old, lost, have, deadline, context, rs
                            )
                            log.warning(
                                "request %s: decode worker %s lost (%s); resumed on %s after %d tokens",
                                rid,
                                old.worker_id,
                                lost,
                                worker.worker_id,
                                active.carried,
                            )
                            continue
                        if ev is None:  # (moved, and it may not resume after all)
                            raise UpstreamError(lost, grpc.StatusCode.UNAVAILABLE)
                        if isinstance(ev, grpc.aio.AioRpcError):
                            raise ev
                        if ev is grpc.aio.EOF:
                            raise Unavailable("decode stream ended without a finish")
                        close_seq = ev.close_seq or close_seq
                        if ev.error:
                            code = status_code(ev.error_code) if ev.error_code else None
                            failure = ev.error if code else f"decode failed: {ev.error}"
                            raise UpstreamError(failure, code)
                        if (ev.logprobs or ev.prompt_logprobs) and self.front.tokenizer is not None:
                            await self._name_tokens(ev)
                        if ev.token_ids and not active.first and (self.affinity or self.prefill_affinity):
                            # a first token: the prompt's KV is at the worker now, or on its way; and
                            # in the prefix cache of the prefill worker that computed it
                            full = self.prefixes.chain(ids, request.cache_salt, hashes)
                            if self.affinity:
                                self._record(worker, full)
                            if self.prefill_affinity and ev.prefill_worker:  # (a prefill worker's run is "")
                                self._record(
                                    WorkerInfo(ev.prefill_worker, "prefill", "", ""), full, self.prefill_prefixes
                                )
                        if (
                            ev.token_ids
                            and not active.first
                            and params.prompt_logprobs is not None
                            and not active.carried
                            and len(ev.prompt_logprobs) != len(ids) - 1
                        ):
                            raise UpstreamError(
                                f"prompt log probabilities: {len(ev.prompt_logprobs)} came for a "
                                f"{len(ids)}-token prompt (a worker of a release without them?)",
                                grpc.StatusCode.INTERNAL,
                            )
                        if ev.token_ids or ev.finish_reason:
                            active.first = True
                        if ev.token_ids and not first_token:
                            first_token = active.first_token = time.time()
                        if active.queued and (ev.token_ids or ev.finish_reason):
                            active.queued = False
                            await self._dequeue(rid, work)
                        if ev.first_token_unix and rid not in self.first_parts:  # (a resumed leg's: not the first)
                            ev.timings.admission_ms = (t_admitted - t_recv) * 1000
                            ev.timings.first_token_ms = (time.time() - ev.first_token_unix) * 1000
                            self.first_parts[rid] = ev.timings
                        if ev.completion_tokens:
                            sent_by[ev.index] = ev.completion_tokens
                            sent = active.sent = sum(sent_by.values())
                        cached = ev.cached_tokens or cached
                        last = ev.finish_reason and not ev.more
                        if last:
                            final = ev
                            if params.n > 1:  # recorded with every sample's tokens
                                final = w_pb.DecodeEvent(
                                    finish_reason=ev.finish_reason,
                                    completion_tokens=sent,
                                    cached_tokens=ev.cached_tokens,
                                )
                        if results is not None:
                            results[ev.index].add(ev)
                            if last and ev.finish_reason != "cancelled":
                                # Recorded before the client has the last message, so that a re-send
                                # following it finds the request finished (its replay), not running.
                                with tracing.tracer().start_span("finish", context=rs.ctx):
                                    await self._mark(rid, "finished", final, results=results, first_token=first_token)
                                marked = True
                        have.add(ev)
                        yield rid, public_id, len(ids), ev
                        if last:
                            if self.affinity and have.tokens[0]:  # the KV of all but the last token is cached there
                                self._record(
                                    worker, self.prefixes.chain(ids + have.tokens[0][:-1], request.cache_salt, hashes)
                                )
                            break
                except asyncio.CancelledError:
                    if active.lost:
                        state = "failed"
                        raise UpstreamError(active.lost, active.lost_code) from None
                    if not active.aborted:
                        state = "cancelled"
                        raise
                    state = "cancelled"
                    final = w_pb.DecodeEvent(finish_reason="cancelled", completion_tokens=sent, cached_tokens=cached)
                    yield rid, public_id, len(ids), final
                except GeneratorExit:
                    # The client cancelled while its handler was writing a message, not reading one:
                    # the handler's task is cancelled outside this generator, which is then closed.
                    state = "cancelled"
                    raise
                state = "cancelled" if final.finish_reason == "cancelled" else "finished"
                if not marked:
                    with tracing.tracer().start_span("finish", context=rs.ctx):
                        await self._mark(rid, state, final, first_token=first_token)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.CANCELLED and active is not None and active.lost:
                    state = "failed"
                    raise UpstreamError(active.lost, active.lost_code) from None
                if e.code() == grpc.StatusCode.CANCELLED and active is not None and active.aborted:
                    state = "cancelled"
                    yield (
                        rid,
                        public_id,
                        len(ids),
                        w_pb.DecodeEvent(finish_reason="cancelled", completion_tokens=sent, cached_tokens=cached),
                    )
                    await self._mark(rid, state, first_token=first_token)
                    return
                state = "cancelled" if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else "failed"
                if e.code() == grpc.StatusCode.UNAVAILABLE:  # say which worker, not just "Socket closed"
                    raise Unavailable(
                        f"decode worker {worker.worker_id} at {worker.address} went away ({e.details()}); retry"
                    ) from e
                raise
            finally:
                if placed is not None:
                    self.placements.ended(worker.worker_id, placed, close_seq, len(ids) + sent)
                if active is not None and self.active.get(rid) is active:  # not another request's (a reused id's)
                    del self.active[rid]
                    self.first_parts.pop(rid, None)
                if state == "finished" and not call.done():
                    # Its status follows its last event: cancelled now, the call would race the worker's
                    # sending it, which gRPC there logged as the servicer's error (a soak: 1 of ~7000).
                    self.background.start(_cancel_once_ended(call, STATUS_WAIT_S))
                else:
                    call.cancel()
                if queued or (active is not None and active.queued):
                    await self._dequeue(rid, work)
                if state in ("cancelled", "failed"):
                    why = failure or (active.lost if active is not None else "")
                    if not why and state == "failed" and isinstance(sys.exc_info()[1], Unavailable):
                        why = str(sys.exc_info()[1])  # its decode worker went away, or it could not resume
                    # Redis not answering: recording it would keep the client waiting as long again.
                    await self._mark(
                        rid,
                        state,
                        error=why,
                        away=isinstance(sys.exc_info()[1], REDIS_UNREACHABLE),
                        first_token=first_token,
                    )
        except BaseException as e:
            failed_with = e
            raise
        finally:  # (a `with dec`, but dec is another span once the request resumes elsewhere)
            if dec is not None:
                dec.__exit__(type(failed_with) if failed_with is not None else None, failed_with, None)

    @staticmethod
    async def _accepted(call, worker: WorkerInfo, placed: Placement):
        """Waits for the decode worker to accept the stream: None once it has. A worker lost as the
        stream opens (killed, its registry entry not yet lapsed, or draining) gives what came
        instead, gRPC's UNAVAILABLE error or the stream's end, for the caller to resume the request
        on another (the read loop of _events) or to raise (_raise_unaccepted)."""
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            return e
        if first is grpc.aio.EOF:
            return first
        if not first.accepted:
            raise Unavailable(f"decode worker {worker.worker_id} did not accept the request")
        Placements.accepted(placed, first.epoch, first.open_seq)
        return None

    @staticmethod
    def _raise_unaccepted(lost, worker: WorkerInfo) -> None:
        if isinstance(lost, BaseException):
            raise lost
        if lost is not None:
            raise Unavailable(f"decode worker {worker.worker_id} did not accept the request")

    async def _resume(
        self,
        rid: str,
        a: Active,
        lost: WorkerInfo,
        why: str,
        have: Sent,
        deadline: float,
        context,
        rs: tracing.rpc_span,
    ) -> tuple:
        """Resume a request whose decode worker was lost (killed, unreachable, or stopped past its
        drain time) on another: its prompt and the tokens its client has (`have`, with the
        characters of their text; none yet, if it was lost before its first token) are prefilled
        again, by a prefill worker or by the new decode worker (as _prefill_locally says), which goes on from
        there and sends only what is new. A request of sampling.n > 1 samples, once any has tokens:
        the new decode worker prefills each sample not finished (Sent.unfinished, resume_samples),
        each going on from its own tokens. This is a new leg (resume.lua): a job of an earlier one,
        still queued or prefilling for the lost worker, is superseded. Greedy or seeded, the stream
        is the one it would have been (the engine skips the draws of the tokens carried). Returns
        (the new Decode call, its worker, its placement, its span)."""
        ids, params = a.ids, a.params
        generated, chars, samples = have.tokens[0], have.chars[0], have.unfinished(params.n)
        if generated:  # its prompt log probabilities went with its first token
            params = dataclasses.replace(params, prompt_logprobs=None)
        tokens = ids + generated
        carried = have.carried(params.n)
        try:
            worker, placed, _ = self.pick(len(ids) + params.n * params.max_tokens, exclude=lost.worker_id)
        except ServiceError as e:
            raise Unavailable(
                f"decode worker {lost.worker_id} was lost ({why}), and the request could not resume on another: {e}"
            ) from None
        local = bool(samples) or self._prefill_locally(len(tokens))
        a.resumes += 1
        log.info("request %s: decode worker %s lost (%s); resuming on %s", rid, lost.worker_id, why, worker.worker_id)
        rs.span.add_event(
            "resumed",
            {
                "splitserve.decode_worker.lost": lost.worker_id,
                "splitserve.decode_worker": worker.worker_id,
                "splitserve.lost.reason": why[:300],
                "splitserve.resumed_tokens": carried,
                "splitserve.prefill.local": local,
            }
            | ({"splitserve.resumed_samples": len(samples)} if samples else {}),
        )
        dec = tracing.rpc_span(
            "splitserve.v1.DecodeWorker/Decode",
            kind=tracing.SpanKind.CLIENT,
            parent=rs.ctx,
            attributes=tracing.rpc_attributes("splitserve.v1.DecodeWorker/Decode")
            | {
                "server.address": worker.address,
                "splitserve.decode_worker": worker.worker_id,
                "splitserve.resumed_tokens": carried,
            },
        )
        dreq = w_pb.DecodeRequest(
            request_id=rid, prompt_tokens=len(ids), deadline_unix=deadline, priority=a.priority, leg=a.resumes
        )
        if samples:
            dreq.prompt_token_ids.extend(ids)
            dreq.resumed_samples.extend(w_pb.ResumedSample(index=i, token_ids=t, chars=c) for i, t, c in samples)
        elif local:
            dreq.prompt_token_ids.extend(tokens)
            dreq.resumed_tokens, dreq.resumed_chars = len(generated), chars
        if local:
            dreq.sampling.CopyFrom(convert.sampling_to_pb(params))
            dreq.cache_salt = a.cache_salt
        call = None
        try:
            peer = self.peers.get(worker.address)
            peer.run = peer.run or worker.epoch
            call = peer.stub.Decode(dreq, timeout=context.time_remaining(), metadata=tracing.inject(dec.ctx))
            if local:
                self._raise_unaccepted(await self._accepted(call, worker, placed), worker)
            now = time.time()
            job = Job(
                request_id=rid,
                token_ids=tokens,
                sampling=sampling_to_dict(params),
                decode_worker=worker.worker_id,
                decode_address=worker.address,
                decode_epoch=worker.epoch,
                decode_host_id=worker.host_id,
                deadline_unix=deadline,
                traceparent=tracing.traceparent_of(rs.span),
                t_received=now,
                t_admitted=now,
                priority=a.priority,
                cache_salt=a.cache_salt,
                resumed=len(generated),
                resumed_chars=chars,
                leg=a.resumes,
            )
            ok, q, t = (
                int(x)
                for x in await self.scripts.run(
                    scripts.resume(
                        self.keys,
                        request_id=rid,
                        job_json=job.to_json(),
                        priority=a.priority,
                        tokens=len(tokens),
                        max_requests=self.s.max_queue_requests,
                        max_tokens=self.s.max_queue_tokens,
                        ttl_s=self.s.request_ttl_s,
                        queue=not local,
                        lost_worker=lost.worker_id,
                    )
                )
            )
            if ok == -2 and not a.aborted and await self.redis.hget(self.keys.req(rid), "aborted") == b"1":
                # An Abort through another router, whose Cancel could not reach the lost worker: it is
                # answered as this router's own (before, the stream failed UNAVAILABLE "it has ended").
                a.aborted = True
            if ok == -2 and a.aborted:
                raise asyncio.CancelledError()  # (answered as the Abort's: _events)
            if ok != 1:
                raise Unavailable(
                    f"decode worker {lost.worker_id} was lost ({why}), and the request could not resume "
                    "on another: "
                    + ("it has ended (see GetRequest)" if ok == -2 else f"the queue is full ({q} requests, {t} tokens)")
                )
            if not local:
                self._raise_unaccepted(await self._accepted(call, worker, placed), worker)
        except BaseException as e:
            if call is not None:
                call.cancel()
            self.placements.ended(worker.worker_id, placed)
            dec.__exit__(type(e), e, None)
            raise
        self.metrics.resumed.inc()
        a.call, a.address, a.local, a.first, a.carried = call, worker.address, local, False, carried
        if a.aborted:  # an Abort that came meanwhile cancelled the lost worker's call, not this one
            call.cancel()
        self._cut_if_stopping(rid, a)
        return call, worker, placed, dec

    @staticmethod
    def _end_admission(adm, e: BaseException) -> None:
        if isinstance(e, Recorded):  # not admitted: answered with its recorded result
            adm.set_attribute("splitserve.replayed", True)
            adm.end()
            return
        code = code_of(e)
        adm.set_attribute("rpc.grpc.status_code", code.value[0])
        if code != grpc.StatusCode.CANCELLED:
            adm.set_status(tracing.Status(tracing.StatusCode.ERROR, f"{code.name}: {e}"[:300]))
        adm.end()

    def _genai_attributes(self, request, rid: str, ids: list[int], params: SamplingParams, resumed: int) -> dict:
        kind = request.WhichOneof("input")
        attrs = {
            "splitserve.request_id": rid,
            "gen_ai.operation.name": "chat" if kind == "messages" else "text_completion",
            "gen_ai.system": "splitserve",
            "gen_ai.request.model": self.front.name,
            "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.usage.input_tokens": len(ids),
        }
        if params.top_k:
            attrs["gen_ai.request.top_k"] = params.top_k
        if params.seed is not None:
            attrs["gen_ai.request.seed"] = params.seed
        if params.presence_penalty:
            attrs["gen_ai.request.presence_penalty"] = params.presence_penalty
        if params.frequency_penalty:
            attrs["gen_ai.request.frequency_penalty"] = params.frequency_penalty
        if params.repetition_penalty != 1.0:
            attrs["splitserve.request.repetition_penalty"] = params.repetition_penalty
        if params.logprobs is not None:
            attrs["splitserve.request.logprobs"] = params.logprobs
        if params.prompt_logprobs is not None:
            attrs["splitserve.request.prompt_logprobs"] = params.prompt_logprobs
        if params.structured_output is not None:
            attrs["splitserve.request.structured_output"] = params.structured_output.kind
        if params.n > 1:
            attrs["gen_ai.request.choice.count"] = params.n
        if request.priority:
            attrs["splitserve.priority"] = request.priority
        if resumed:  # a stream sent again to go on (resume_from): the tokens its client had
            attrs["splitserve.resume_from.tokens"] = resumed
        return attrs

    def _record(self, worker: WorkerInfo, hashes: list[int], index: PrefixIndex | None = None) -> None:
        """worker holds the KV of these blocks now: in this router's record (`index`: the decode
        workers', or the prefill workers'), and the others'."""
        (self.prefixes if index is None else index).record(worker.worker_id, hashes)
        self.shared.publish(worker.worker_id, worker.epoch, hashes)

    async def _name_tokens(self, ev: w_pb.DecodeEvent) -> None:
        """Set the text of each token in the event's log probabilities (~1 us a token and 0.4 us
        for each of the most likely with it, measured; a long prompt's on a thread, so the loop
        gets its turns meanwhile)."""
        n = len(ev.prompt_logprobs) + len(ev.logprobs)
        if n > NAME_TOKENS_INLINE:
            await asyncio.to_thread(name_tokens, self.front.tokenizer, ev.logprobs, ev.prompt_logprobs)
        else:
            name_tokens(self.front.tokenizer, ev.logprobs, ev.prompt_logprobs)

    async def _mark(
        self,
        rid: str,
        state: str,
        final=None,
        error: str = "",
        results: dict[int, Result] | None = None,
        away: bool = False,
        first_token: float = 0.0,
    ) -> None:
        """Record how a request ended (with its last decode event, if any, and what it sent of each
        sample, for a replay); the hash then expires sooner. While Redis is away (`away`: the
        request failed for it), in the background until it answers: the caller does not wait."""
        key = self.keys.req(rid)
        mapping = {"state": state, "t_finished": time.time()}
        if first_token:
            mapping["t_first_token"] = first_token
        if final is not None:
            mapping.update(
                completion_tokens=final.completion_tokens,
                finish_reason=final.finish_reason,
                cached_tokens=final.cached_tokens,
            )
        if results is not None and len(results) > 1:  # every sample's, as text (below)
            mapping["result_samples"] = message_to_text(
                gen_pb.GenerateResponse(choices=[r.message(i) for i, r in sorted(results.items())])
            )
            mapping["result_starts"] = ",".join(
                f"{r.start}:{r.start_chars}:{int(r.before)}" for _, r in sorted(results.items())
            )
        elif results is not None:
            # As text: the hash is read whole and decoded (GetRequest).
            result = results[0]
            mapping.update(result_tokens=",".join(map(str, result.tokens)), result_text="".join(result.texts))
            if result.start:
                mapping.update(result_start=result.start, result_start_chars=result.start_chars)
            if result.logprobs or result.prompt_logprobs:
                mapping["result_logprobs"] = message_to_text(
                    gen_pb.GenerateResponse(logprobs=result.logprobs, prompt_logprobs=result.prompt_logprobs)
                )
        if error:
            mapping["error"] = fit_details(error)  # (a worker of another release may send it whole)

        async def record():
            async with self.redis.pipeline(transaction=False) as p:
                p.hset(key, mapping=mapping)
                p.expire(key, self.s.finished_ttl_s)
                p.srem(self.keys.router_requests(self.id), rid)
                await p.execute()

        try:
            await self._write(record, f"the end of {rid}", away)
        except Exception:  # noqa: BLE001 - bookkeeping must not hide the real outcome
            log.exception("could not record the end of %s", rid)

    def _timings(self, rid: str, t0: float, t_first: float | None, ev) -> gen_pb.Timings:
        now = time.perf_counter()
        tm = gen_pb.Timings()
        first = self.first_parts.get(rid)
        if first is not None:
            tm.CopyFrom(first)
            if ev is not None and ev.timings.kv_transfer_ms:  # the KV may land after the first token went out
                tm.kv_transfer_ms = ev.timings.kv_transfer_ms
        elif ev is not None and ev.HasField("timings"):
            tm.CopyFrom(ev.timings)
        tm.e2e_ms = (now - t0) * 1000
        if t_first is not None:
            tm.ttft_ms = (t_first - t0) * 1000
            tm.decode_ms = (now - t_first) * 1000
        return tm

    def _server_span(self, method: str, context) -> tracing.rpc_span:
        full = f"{SERVICE}/{method}"
        return tracing.rpc_span(
            full, parent=tracing.extract(context.invocation_metadata()), attributes=tracing.rpc_attributes(full)
        )

    def _finish(
        self,
        rs: tracing.rpc_span,
        resp: gen_pb.GenerateResponse,
        rid: str,
        n_prompt: int,
        ev,
        t0: float,
        t_first: float | None,
        ended: list,
        n: int,
    ) -> None:
        """A sample's last message: its finish reason, usage and timings. ended: the finish events of
        the request's samples so far, this one's last; the last sample's (or a cancellation) records
        the request on the span and in the metrics. n: its samples (TPOT is its longest one's steps)."""
        resp.finish_reason = ev.finish_reason
        resp.usage.CopyFrom(
            gen_pb.Usage(prompt_tokens=n_prompt, completion_tokens=ev.completion_tokens, cached_tokens=ev.cached_tokens)
        )
        resp.timings.CopyFrom(self._timings(rid, t0, t_first, ev))
        if ev.more:
            return
        t = resp.timings
        out = sum(e.completion_tokens for e in ended) if ev.finish_reason != "cancelled" else ev.completion_tokens
        rs.span.set_attributes(
            {
                "gen_ai.usage.output_tokens": out,
                "gen_ai.usage.cache_read.input_tokens": resp.usage.cached_tokens,
                "gen_ai.response.finish_reasons": [e.finish_reason for e in ended],
                "splitserve.ttft_ms": t.ttft_ms,
                "splitserve.e2e_ms": t.e2e_ms,
            }
        )
        if resp.finish_reason == "cancelled":
            self.metrics.cancelled.labels("abort").inc()
        self.metrics.prompt_tokens_cached.inc(resp.usage.cached_tokens)
        longest = max(e.completion_tokens for e in ended) if ev.finish_reason != "cancelled" else 0
        self.metrics.observe_finished(t, resp.finish_reason, out, longest if n > 1 else None)

    def _replayed(
        self, rs: tracing.rpc_span, responses: list[gen_pb.GenerateResponse], t0: float
    ) -> list[gen_pb.GenerateResponse]:
        """A finished request's recorded result, sent again (a message a sample): on the span and in
        the metrics as such."""
        for resp in responses:
            resp.timings.e2e_ms = (time.perf_counter() - t0) * 1000
        rs.span.set_attributes(
            {
                "splitserve.replayed": True,
                "gen_ai.response.finish_reasons": [r.finish_reason for r in responses],
                "gen_ai.usage.output_tokens": sum(r.usage.completion_tokens for r in responses),
            }
        )
        self.metrics.replayed.inc()
        return responses

    def _record_error(self, e: BaseException) -> None:
        code = code_of(e)
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            self.metrics.refused.labels("queue_full").inc()
        elif code == grpc.StatusCode.CANCELLED:  # by the client, or by an Abort that came before it
            self.metrics.cancelled.labels("abort" if isinstance(e, Cancelled) else "client").inc()
        elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
            self.metrics.cancelled.labels("deadline").inc()
        else:
            self.metrics.failed.labels(code.name).inc()

    async def GenerateStream(self, request, context):
        t0 = time.perf_counter()
        t_first = None
        self.metrics.in_flight.inc()
        self.calls += 1
        try:
            with self._server_span("GenerateStream", context) as rs:
                try:
                    ended = []
                    async for rid, public_id, n_prompt, ev in self._events(request, context, rs):
                        resp = gen_pb.GenerateResponse(
                            request_id=public_id,
                            token_ids=ev.token_ids,
                            text=ev.text,
                            logprobs=ev.logprobs,
                            prompt_logprobs=ev.prompt_logprobs,
                            index=ev.index,
                        )
                        if t_first is None and ev.token_ids:
                            t_first = time.perf_counter()
                            rs.span.add_event("first_token")
                        if ev.finish_reason:
                            ended.append(ev)
                            self._finish(rs, resp, rid, n_prompt, ev, t0, t_first, ended, request.sampling.n)
                        yield resp
                except Recorded as r:
                    for resp in self._replayed(rs, r.responses, t0):
                        yield resp
        except BaseException as e:
            self._record_error(e)
            raise
        finally:
            self.metrics.in_flight.dec()
            self.calls -= 1

    async def Generate(self, request, context):
        t0 = time.perf_counter()
        t_first = None
        samples: dict[int, tuple[gen_pb.GenerateResponse, list[str]]] = {}  # index -> (its response, its texts)
        ended = []
        self.metrics.in_flight.inc()
        self.calls += 1
        try:
            with self._server_span("Generate", context) as rs:
                try:
                    async for rid, public_id, n_prompt, ev in self._events(request, context, rs):
                        resp, text = samples.setdefault(ev.index, (gen_pb.GenerateResponse(index=ev.index), []))
                        resp.request_id = public_id
                        if t_first is None and ev.token_ids:
                            t_first = time.perf_counter()
                            rs.span.add_event("first_token")
                        resp.token_ids.extend(ev.token_ids)
                        resp.logprobs.extend(ev.logprobs)
                        resp.prompt_logprobs.extend(ev.prompt_logprobs)
                        text.append(ev.text)
                        if ev.finish_reason:
                            ended.append(ev)
                            self._finish(rs, resp, rid, n_prompt, ev, t0, t_first, ended, request.sampling.n)
                except Recorded as r:
                    return joined(
                        {resp.index: resp for resp in self._replayed(rs, r.responses, t0)}, request.sampling.n
                    )
        except BaseException as e:
            self._record_error(e)
            raise
        finally:
            self.metrics.in_flight.dec()
            self.calls -= 1
        for resp, text in samples.values():
            resp.text = "".join(text)
        return joined({i: resp for i, (resp, _) in samples.items()}, request.sampling.n)

    async def Abort(self, request, context):
        convert.check_request_id(request.request_id, required=True)
        self._check_redis()
        rid = await self._latest(request.request_id)
        # Marked cancelled unless it has ended (a prefill worker then skips it, or aborts it between forwards).
        call = scripts.abort(
            self.keys, request_id=rid, now=time.time(), finished_ttl_s=self.s.finished_ttl_s,
            early_ttl_s=EARLY_ABORT_KEEP_S,
        )  # fmt: skip
        state, wid = (x.decode() if isinstance(x, bytes) else str(x or "") for x in await self.scripts.run(call))
        if not state:
            raise NotFound(
                f"no request {request.request_id!r} (yet: if it arrives within {EARLY_ABORT_KEEP_S} s, "
                "it is refused as cancelled)"
            )
        active = self.active.get(rid)
        if active is not None:
            active.aborted = True
            active.call.cancel()
        elif state not in FINAL_STATES:  # another router holds its stream: end it at its decode worker
            await self._cancel_at_worker(rid, wid)
        return gen_pb.AbortResponse(found=True, state=state)

    async def _cancel_at_worker(self, rid: str, wid: str) -> None:
        """Ask the request's decode worker to end its stream (finish_reason "cancelled") and free
        its KV; the router holding the stream then finishes it as it would its own abort."""
        address = next((w.address for w in self.workers if w.worker_id == wid), "")
        if not address and wid:  # registered since the last registry read
            address = (await self.redis.hget(self.keys.worker("decode", wid), "address") or b"").decode()
        if not address:
            log.warning(
                "abort %s: its decode worker %s is not registered (its stream ends when the worker goes)", rid, wid
            )
            return
        try:
            await self.stub(address).Cancel(w_pb.CancelRequest(request_id=rid), timeout=5.0)
        except grpc.aio.AioRpcError as e:
            log.warning("abort %s: Cancel at decode worker %s failed: %s", rid, address, e.code().name)

    async def GetRequest(self, request, context):
        rid = request.request_id
        convert.check_request_id(rid, required=True)
        self._check_redis()
        m = await self.redis.hgetall(self.keys.req(rid))
        if m.get(b"early") == b"1":
            raise NotFound(f"no request {rid!r} (an Abort for it came first: it is refused if it arrives)")
        attempts = int(m.get(b"attempts", 1))
        if current := m.get(b"current"):  # sent again after it ended unfinished: its latest attempt
            m = await self.redis.hgetall(self.keys.req(current.decode()))
        if not m:
            raise NotFound(f"no request {rid!r} (unknown, or expired)")
        m = {k.decode(): v.decode() for k, v in m.items()}
        return gen_pb.RequestInfo(
            request_id=rid,
            state=m.get("state", ""),
            attempts=attempts,
            timestamps={k[2:]: float(v) for k, v in m.items() if k.startswith("t_")},
            prefill_worker=m.get("prefill_worker", ""),
            decode_worker=m.get("decode_worker", ""),
            prompt_tokens=int(m.get("prompt_tokens", 0)),
            completion_tokens=int(m.get("completion_tokens", 0)),
            cached_tokens=int(m.get("cached_tokens", 0)),
            finish_reason=m.get("finish_reason", ""),
            error=m.get("error", ""),
            kv_transport=m.get("kv_transport", ""),
            kv_bytes=int(m.get("kv_bytes", 0)),
            resumes=int(m.get("resumed", 0)),
        )

    async def Tokenize(self, request, context):
        kind = request.WhichOneof("input")
        if kind is None:
            raise InvalidRequestError("input", "one of prompt or messages is required")
        as_generate = gen_pb.GenerateRequest(**{kind: getattr(request, kind)})
        # Any length the router reads (max_request_bytes): counting a text that does not fit is the point.
        if self.front.check_input_size(as_generate, truncating=True) > INLINE_TOKENIZE_CHARS:
            ids = await asyncio.to_thread(self.front.prompt_ids, as_generate)
        else:
            ids = self.front.prompt_ids(as_generate)
        return gen_pb.TokenizeResponse(
            token_ids=ids, count=len(ids), max_model_len=self.front.context, model=self.front.name
        )

    async def Detokenize(self, request, context):
        tok = self.front.tokenizer
        if tok is None:
            raise InvalidRequestError("token_ids", "this model has no tokenizer")
        ids = list(request.token_ids)
        check_vocab("token_ids", ids, self.front.vocab)
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        if len(ids) > INLINE_TOKENIZE_CHARS:
            return gen_pb.DetokenizeResponse(text=await asyncio.to_thread(tok.decode, ids, skip))
        return gen_pb.DetokenizeResponse(text=tok.decode(ids, skip))


async def serve(settings: Settings, stop: asyncio.Event) -> None:
    frontend = await asyncio.to_thread(Frontend, settings)
    r = connect(settings.redis_url, settings.redis_cluster, asyncio=True)
    metrics = RouterMetrics()
    metrics.queue_limit_requests.set(int(settings.max_queue_requests * settings.admit_fraction))
    metrics.queue_limit_tokens.set(int(settings.max_queue_tokens * settings.admit_fraction))
    servicer = RouterServicer(settings, frontend, r, metrics)
    await servicer.reap(servicer.id)  # what an earlier life under this id left
    await servicer.keep_alive()
    await servicer.refresh_workers()
    server = grpc_server.new_server(settings.keepalive_s, frontend.max_request_bytes())
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    port, health = await grpc_server.start(server, settings.host, settings.port, [SERVICE])
    metrics_port = metrics.serve(settings.host, settings.metrics_port)

    async def refresh():
        while True:
            await asyncio.sleep(settings.heartbeat_s / 2)
            try:
                await servicer.keep_alive()
                await servicer.refresh_workers()
                q, t = queue_counts(await r.hmget(servicer.keys.admission, *QUEUE_FIELDS))
                metrics.queue_requests.set(q)
                metrics.queue_tokens.set(t)
                metrics.decode_workers.set(len(servicer.workers))
                await servicer.reap()
                await servicer.check_waiting()
                await servicer.record_progress()
                await servicer.close_idle_channels()
            except Exception as e:  # noqa: BLE001
                log.warning("registry refresh failed: %s", e)

    task = asyncio.create_task(refresh())
    sharing = (
        asyncio.create_task(servicer.shared.run()) if servicer.affinity and settings.share_prefix_records else None
    )
    address = settings.address(port)
    log.info("router serving on %s", address)
    if metrics_port:
        print(f"METRICS {settings.host}:{metrics_port}", flush=True)
    print(f"READY {address}", flush=True)
    await stop.wait()
    await grpc_server.set_not_serving(health, [SERVICE])
    task.cancel()
    if sharing is not None:
        sharing.cancel()
    # In-flight requests finish, new ones are refused (gRPC sends them to the other routers). Those
    # still running when DRAIN_S is over fail UNAVAILABLE saying so, and are recorded failed: gRPC's own
    # cut would say "Cancelling all calls", and the hash "cancelled", as if their clients had.
    stopping = asyncio.create_task(server.stop(grace=settings.drain_s + 5.0))
    t_end = time.monotonic() + settings.drain_s
    # (the calls in hand, not only the active requests: one still in admission is not active yet,
    # and a drain over before its admission was would cut it off as it came out)
    while (servicer.active or servicer.calls) and time.monotonic() < t_end:
        await asyncio.sleep(0.05)
    servicer.cut_off(
        f"router {servicer.id} stopped before this request finished (its drain of "
        f"{settings.drain_s:g} s ran out); retry"
    )
    await stopping
    for peer in servicer.peers.clear():  # their watchers end with them
        await peer.channel.close()
    try:
        await servicer.reap(servicer.id)  # leaves the routers set; anything not ended is marked failed
    except Exception as e:  # noqa: BLE001 - Redis may be gone too
        log.warning("could not leave the routers set: %s", e)
    await r.aclose()
    metrics.close()
    log.info("router stopped")
