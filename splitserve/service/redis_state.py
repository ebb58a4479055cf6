"""Queue state in Redis: the prefill stream, request hashes, admission, worker registry.

Keys (all under one prefix, in braces: a Redis Cluster hash tag, so every key is in one slot
and the scripts, which touch several keys at once, run on a cluster too):
  {p}:prefill            stream of prefill jobs, consumer group "prefill"  (persistent)
  {p}:prefill:high       the same for priority < 0 (pulled first)            (persistent)
  {p}:prefill:low        the same for priority > 0 (pulled last)             (persistent)
  {p}:prefill:to:{id}    the same for the normal-priority jobs sent to one prefill worker (prefill
                         affinity: its prefix cache holds the start of their prompts); read by it,
                         and by any worker once it has left the registry; deleted when left empty
  {p}:prefill:directed   set: the prefill workers that have such a stream           (persistent)
  {p}:admission          hash: requests, tokens queued (admitted, not yet pulled, or prefilled by their
                         decode worker and not yet at their first token), local_tokens: those
                         prefilled by their decode worker (persistent)
  {p}:req:{id}           hash per request; TTL while active, shorter TTL after completion
  {p}:worker:{role}:{id} registry entry; TTL = heartbeat lease
  {p}:routers            sorted set: router id -> its lease's end (unix); a router past it is dead  (persistent)
  {p}:router:{id}:requests  set: that router's requests that have not ended; TTL refreshed by its heartbeat
Payload bulk (KV) never goes through Redis.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import MISSING, asdict, dataclass, fields

import grpc

from splitserve.engine.params import SamplingParams
from splitserve.engine.structured import StructuredOutput
from splitserve.service.convert import CACHE_SALT_MAX_CHARS
from splitserve.service.errors import fit_details

log = logging.getLogger(__name__)

GROUP = "prefill"

ACTIVE_STATES = ("queued", "prefilling", "decoding")
FINAL_STATES = ("finished", "cancelled", "failed")
# The scripts' test for a request that has ended (a nil state, no request, is not final).
_IS_FINAL = "local function is_final(s) return " + " or ".join(f"s == '{x}'" for x in FINAL_STATES) + " end\n"

# A request_id may be sent again (as a new attempt) once its latest attempt has ended without
# finishing and without an Abort: it failed, or it was cancelled by its client going away or by
# its deadline. A nil state is an attempt whose hash expired: it has ended. An aborted one stays
# ended, and a finished one never runs twice (the router answers with its recorded result).
MAY_RUN_AGAIN = ("failed", "cancelled")
_MAY_RUN_AGAIN = (
    "local function may_run_again(state, aborted) return not state or (not aborted and ("
    + " or ".join(f"state == '{x}'" for x in MAY_RUN_AGAIN)
    + ")) end\n"
)

# Admission, request hash and job in one atomic step: nothing is half-queued.
# KEYS: admission, stream, request hash, the router's request set; for a request sent again
# after it ended unfinished (a new attempt, under its own hash: attempt_id), also its first
# attempt's hash and its latest attempt's.  ARGV: tokens, max_requests, max_tokens, fraction,
# ttl, job json, queue the job (0: its decode worker prefills it itself, colocated or by conditional
# disaggregation; its hash says 'local'), the router's id; for a new attempt, the attempts the
# first hash counted when the router read it (another attempt admitted since: refused as -1);
# with a client-chosen id, that count (0 for a first attempt) and the request's fingerprint,
# which the hash keeps ('fingerprint': a retry must be the same request). Returns {admitted
# (1, 0 refused, -1 the id exists, -2 an Abort for it came first: ABORT_LUA), requests, tokens,
# local_tokens}, the counts with this request when it was admitted.
# Prefill affinity: ARGV[11] (ARGV[9] and [10] given, '' when unused) is a bound, and the last two
# KEYS a prefill worker's own stream and its registry entry: the job goes to that stream, not
# KEYS[2], while the worker is registered, its stream is there (its group with it) and holds fewer
# entries than the bound (its jobs not yet done). Then a fifth value returned is 1.
# ARGV[12] '1': a new attempt of a request its client sent again to go on (resume_from), having lost
# its stream (its router went away): a latest attempt still running (not aborted) does not refuse
# it but is superseded, marked failed ('superseded'), once this one is admitted.
ADMIT_LUA = (
    _MAY_RUN_AGAIN
    + _IS_FINAL
    + """
local nd = (ARGV[11] and ARGV[11] ~= '') and 2 or 0
local supersede = false
if #KEYS - nd > 4 then
  local first = redis.call('HMGET', KEYS[5], 'state', 'attempts')
  local latest = redis.call('HMGET', KEYS[6], 'state', 'aborted')
  if not first[1] or (first[2] or '1') ~= ARGV[9] then
    return {-1, 0, 0, 0}
  end
  if not may_run_again(latest[1], latest[2]) then
    if ARGV[12] ~= '1' or latest[2] or not latest[1] or is_final(latest[1]) then
      return {-1, 0, 0, 0}
    end
    supersede = true
  end
end
if redis.call('EXISTS', KEYS[3]) == 1 then
  return {redis.call('HGET', KEYS[3], 'early') == '1' and -2 or -1, 0, 0, 0}
end
local q = tonumber(redis.call('HGET', KEYS[1], 'requests') or '0')
local t = tonumber(redis.call('HGET', KEYS[1], 'tokens') or '0')
local lt = tonumber(redis.call('HGET', KEYS[1], 'local_tokens') or '0')
local n = tonumber(ARGV[1])
local frac = tonumber(ARGV[4])
if q + 1 > math.floor(tonumber(ARGV[2]) * frac) or t + n > math.floor(tonumber(ARGV[3]) * frac) then
  return {0, q, t, lt}
end
redis.call('HINCRBY', KEYS[1], 'requests', 1)
redis.call('HINCRBY', KEYS[1], 'tokens', n)
local job = cjson.decode(ARGV[6])
-- prompt_tokens: the prompt's (a job's tokens may end with completion tokens its client has: resumed);
-- queued_tokens: all it counts in the queue, returned once (a local one's by REAP_LUA)
local prompt = job['token_ids'] and #job['token_ids'] - (job['resumed'] or 0) or n
redis.call('HSET', KEYS[3], 'state', 'queued', 'prompt_tokens', prompt, 'queued_tokens', n,
           't_admitted', job['t_admitted'], 'decode_worker', job['decode_worker'],
           't_received', job['t_received'], 'priority', job['priority'], 'router', ARGV[8])
if ARGV[10] and ARGV[10] ~= '' then
  redis.call('HSET', KEYS[3], 'fingerprint', ARGV[10])
end
redis.call('EXPIRE', KEYS[3], tonumber(ARGV[5]))
redis.call('SADD', KEYS[4], job['request_id'])
redis.call('EXPIRE', KEYS[4], tonumber(ARGV[5]))
local directed = 0
if ARGV[7] ~= '0' then  -- 'tokens' lets a worker return the counts of a job it cannot read
  local stream = KEYS[2]
  if nd > 0 and redis.call('EXISTS', KEYS[#KEYS]) == 1 and redis.call('EXISTS', KEYS[#KEYS - 1]) == 1
      and redis.call('XLEN', KEYS[#KEYS - 1]) < tonumber(ARGV[11]) then
    stream = KEYS[#KEYS - 1]
    directed = 1
  end
  -- 'queued': the requests queued with this one; 1 tells an idle worker nothing else waits
  redis.call('XADD', stream, '*', 'job', ARGV[6], 'tokens', n, 'queued', q + 1)
else
  redis.call('HINCRBY', KEYS[1], 'local_tokens', n)
  redis.call('HSET', KEYS[3], 'local', 1)
  lt = lt + n
end
if #KEYS - nd > 4 then  -- the first hash points at this attempt, and lives as long as it may
  redis.call('HSET', KEYS[5], 'attempts', tonumber(ARGV[9]) + 1, 'current', job['request_id'])
  redis.call('EXPIRE', KEYS[5], tonumber(ARGV[5]))
end
if supersede then
  redis.call('HSET', KEYS[6], 'state', 'failed', 'superseded', 1, 't_finished', job['t_admitted'],
             'error', 'superseded by attempt ' .. job['request_id'] .. ': its client lost its stream and sent it again')
  redis.call('EXPIRE', KEYS[6], tonumber(ARGV[5]))
end
return {1, q + 1, t + n, lt, directed}
"""
)

# A request whose decode worker was lost resumes: its prompt and the tokens its client has go to a
# prefill worker again (or to its new decode worker, which prefills them), unless it has ended
# meanwhile (an Abort, a worker's failure) or the queue is full (its bounds themselves: the
# request has been admitted once). Each resume is a leg ('resumed' counts them; the job carries
# its number, Job.leg): a job of an earlier leg, still queued or prefilling for the lost worker,
# is superseded (PICKUP_LUA skips it, returning its own counts; UPDATE_LUA ignores its failure).
# The new job's counts come back at its pickup, under its leg's marker. KEYS: admission hash, the
# stream for its priority, the request hash. ARGV: tokens to prefill, the bounds (requests,
# tokens), the request TTL, the job, 1 to queue it (0: its decode worker prefills it), the lost
# worker's id. Returns {1 | 0 (the queue is full) | -2 (it has ended), requests queued, tokens
# queued}. A request a prefill worker failed because it could not reach that worker ('lost_to':
# its handoff broke as the worker was lost, recorded before its router saw the loss) resumes.
RESUME_LUA = (
    _IS_FINAL
    + """
local got = redis.call('HMGET', KEYS[3], 'state', 'aborted', 'lost_to')
local lost_handoff = got[1] == 'failed' and got[3] and got[3] == ARGV[7]
if not got[1] or (is_final(got[1]) and not lost_handoff) or got[2] then
  return {-2, 0, 0}
end
if lost_handoff then
  redis.call('HDEL', KEYS[3], 'error', 'code', 'lost_to')
end
local job = cjson.decode(ARGV[5])
local n = tonumber(ARGV[1])
local q = tonumber(redis.call('HGET', KEYS[1], 'requests') or '0')
local t = tonumber(redis.call('HGET', KEYS[1], 'tokens') or '0')
if ARGV[6] == '1' then
  if q + 1 > tonumber(ARGV[2]) or t + n > tonumber(ARGV[3]) then
    return {0, q, t}
  end
  redis.call('HINCRBY', KEYS[1], 'requests', 1)
  redis.call('HINCRBY', KEYS[1], 'tokens', n)
  q, t = q + 1, t + n
  redis.call('HDEL', KEYS[3], 'local')
  redis.call('HSET', KEYS[3], 'state', 'queued')
  redis.call('XADD', KEYS[2], '*', 'job', ARGV[5], 'tokens', n, 'queued', q)
else
  redis.call('HSET', KEYS[3], 'state', 'prefilling', 'local', 1, 'dequeued', 1)  -- (in no counts)
end
redis.call('HINCRBY', KEYS[3], 'resumed', 1)
redis.call('HSET', KEYS[3], 'decode_worker', job['decode_worker'], 't_resumed', job['t_admitted'])
redis.call('EXPIRE', KEYS[3], tonumber(ARGV[4]))
return {1, q, t}
"""
)

# Abort marks a request cancelled, in one step with reading its state, so a request that has
# just ended keeps its final state. One that has not arrived yet (its Abort overtook its
# Generate, through another router) gets a hash that says so ('early'), for the early TTL:
# admitted within it, it is refused as cancelled (ADMIT_LUA). An aborted request is marked so
# ('aborted'): its request_id is not run again. KEYS[1] the request hash; ARGV:
# now, the TTL after completion, the early TTL. Returns {the state it had ('' when there is no
# such request), its decode worker's id}.
ABORT_LUA = (
    _IS_FINAL
    + """
local got = redis.call('HMGET', KEYS[1], 'state', 'decode_worker', 'early')
local state = got[1]
if not state or got[3] == '1' then
  redis.call('HSET', KEYS[1], 'state', 'cancelled', 'early', 1, 't_finished', ARGV[1])
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
  return {'', ''}
end
if not is_final(state) then
  redis.call('HSET', KEYS[1], 'state', 'cancelled', 'aborted', 1, 't_finished', ARGV[1])
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[2]))
elseif state ~= 'finished' then  -- it had failed or been cancelled: the Abort says not to run it again
  redis.call('HSET', KEYS[1], 'aborted', 1)
end
return {state, got[2] or ''}
"""
)

# A worker records progress on a request: only on a hash that exists (one that expired, or that a
# Redis restarted empty lost, is not recreated without a TTL), and never moving a request out of
# a final state (a late "decoding" must not hide "cancelled"). KEYS[1] the request hash; ARGV
# field, value, ...; a pair ('_leg', n) says it is of leg n (RESUME_LUA): a job's, or a decode
# stream's: nothing is written once the request has resumed past it (a job superseded, a decode
# worker taken for lost that adopts the KV late: their state, worker and times are not the new
# leg's); a 'decoding' written with its leg records it ('kv_leg', which PICKUP_LUA reads).
# Returns 1 if the hash exists.
UPDATE_LUA = (
    _IS_FINAL
    + """
local got = redis.call('HMGET', KEYS[1], 'state', 'resumed')
local state = got[1]
if not state then return 0 end
local final = is_final(state)
local leg = nil
for i = 1, #ARGV, 2 do
  if ARGV[i] == '_leg' then
    if tonumber(ARGV[i + 1]) < tonumber(got[2] or '0') then return 1 end
    leg = ARGV[i + 1]
  end
end
local args = {}
for i = 1, #ARGV, 2 do
  if ARGV[i] ~= '_leg' and not (final and (ARGV[i] == 'state' or ARGV[i] == 'error' or ARGV[i] == 'code'
                                            or ARGV[i] == 'lost_to')) then
    args[#args + 1] = ARGV[i]
    args[#args + 1] = ARGV[i + 1]
    if leg and ARGV[i] == 'state' and ARGV[i + 1] == 'decoding' then
      args[#args + 1] = 'kv_leg'
      args[#args + 1] = leg
    end
  end
end
if #args > 0 then redis.call('HSET', KEYS[1], unpack(args)) end
return 1
"""
)


# A running request's progress, written by its router every half heartbeat so that GetRequest
# on any router shows it before its end (when the end's write sets them for good). KEYS: request
# hashes (one slot: the prefix's hash tag); ARGV: for each, its completion tokens so far and the
# unix time of its first token. A hash that is gone or ended is left alone: a count read before a
# request's end must not overwrite the one its end wrote, nor bring back an expired hash.
PROGRESS_LUA = (
    _IS_FINAL
    + """
local n = 0
for i, key in ipairs(KEYS) do
  local state = redis.call('HGET', key, 'state')
  if state and not is_final(state) then
    redis.call('HSET', key, 'completion_tokens', ARGV[2 * i - 1], 't_first_token', ARGV[2 * i])
    n = n + 1
  end
end
return n
"""
)


def update_args(mapping: dict) -> list:
    """UPDATE_LUA's ARGV for a mapping."""
    return [x for kv in mapping.items() for x in kv]


def failed(code, error: str) -> dict:
    """The fields of a request a worker failed, for UPDATE_LUA: with the status its client gets
    (code, a grpc.StatusCode), which its router reads there if the decode worker cannot be told."""
    return {"state": "failed", "error": fit_details(error), "code": code.value[0]}


# A request its decode worker prefills (colocated, or by conditional disaggregation) leaves the
# queue at its first token or its end: its router returns the counts then, or, if that router
# went away, REAP_LUA does. Exactly once: the request hash remembers it ('dequeued'); a hash that
# is gone (expired, or Redis restarted empty) returns them, never below zero.
_LEAVE_LOCAL = """
local function leave_local(admission, req, n)
  if redis.call('EXISTS', req) == 1 and redis.call('HSETNX', req, 'dequeued', 1) == 0 then return 0 end
  for _, f in ipairs({'requests', 'tokens', 'local_tokens'}) do
    if redis.call('HINCRBY', admission, f, f == 'requests' and -1 or -n) < 0 then
      redis.call('HSET', admission, f, 0)
    end
  end
  return 1
end
"""

# A router that stopped heartbeating (killed, its host lost) left requests it can no longer
# answer: each that has not ended is marked failed, so GetRequest tells the truth and a prefill
# worker skips the ones still queued (or drops them between forwards). Only if the router is
# still past its lease (unless forced: a router reaps its own id at start and stop), so one
# that came back keeps its requests. The queue counts of its requests that their decode workers
# prefill (which their router returns) are returned here, once. KEYS: the routers set, the
# router's request set, the admission hash, then its request hashes. ARGV: router id, now, TTL
# after completion, 1 to force. Returns how many requests it marked.
REAP_LUA = (
    _IS_FINAL
    + _LEAVE_LOCAL
    + """
local lease = redis.call('ZSCORE', KEYS[1], ARGV[1])
if ARGV[4] ~= '1' and lease and tonumber(lease) > tonumber(ARGV[2]) then return 0 end
local n = 0
for i = 4, #KEYS do
  local got = redis.call('HMGET', KEYS[i], 'state', 'local', 'queued_tokens', 'prompt_tokens')
  local state = got[1]
  if state and not is_final(state) then
    redis.call('HSET', KEYS[i], 'state', 'failed', 'reaped', 1, 't_finished', ARGV[2],
               'error', 'its router ' .. ARGV[1] .. ' went away')
    redis.call('EXPIRE', KEYS[i], tonumber(ARGV[3]))
    n = n + 1
  end
  if state and got[2] == '1' then leave_local(KEYS[3], KEYS[i], tonumber(got[3] or got[4] or '0')) end
end
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[1], ARGV[1])
return n
"""
)

# A prefill worker puts back the hash of a request it holds that Redis no longer has (it restarted
# empty), so the request's router keeps waiting for it instead of ending it. Only where there is
# no hash: one that exists, in whatever state, is left alone. KEYS[1] the request hash; ARGV: TTL,
# then field, value, ...  Returns 1 if it put the hash back.
RESTORE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[1]))
return 1
"""

# A router takes a request back from the prefill queue (no prefill worker is registered: they
# died, or hang) for its decode worker to prefill: only one still queued and not picked up (a
# pickup and a take-back exclude each other). It is then counted as a request its decode worker
# prefills, admitted so (ADMIT_LUA): it leaves the queue at its first token (DEQUEUE_LUA), and a
# prefill worker that pulls its job skips it (PICKUP_LUA). KEYS: admission hash, request hash.
# ARGV: prompt tokens, now. Returns 1 if it took it back.
TAKE_BACK_LUA = """
local got = redis.call('HMGET', KEYS[2], 'state', 'local', 'dequeued')
if got[1] ~= 'queued' or got[2] == '1' or got[3] then return 0 end
redis.call('HSET', KEYS[2], 'local', 1, 't_taken_back', ARGV[2])
redis.call('HINCRBY', KEYS[1], 'local_tokens', tonumber(ARGV[1]))
return 1
"""

# KEYS[1] admission, KEYS[2] the request hash; ARGV[1] prompt tokens. Returns 1 if it returned them.
DEQUEUE_LUA = _LEAVE_LOCAL + "return leave_local(KEYS[1], KEYS[2], tonumber(ARGV[1]))\n"

# Leaving the queue returns a job's admission counts exactly once. The request hash remembers
# it ('dequeued'), so a job claimed from a worker that died between pulling and picking it up
# still returns them, and one picked up before that worker died does not return them twice.
# A hash that is gone (expired) falls back to the delivery: only a first delivery returns them.
# The counts never go below zero (a job picked up by a worker of an older version, which left
# no marker, and then claimed, would otherwise be returned twice).
# Each leg of a resumed request (RESUME_LUA) has a marker of its own ('dequeued:<leg>').
# KEYS[1] admission, KEYS[2] request hash; ARGV[1] prompt tokens, ARGV[2] 1 if first delivery,
# ARGV[6] the job's leg (absent: 0).
_LEAVE_QUEUE = """
local exists = redis.call('EXISTS', KEYS[2]) == 1
local marker = (ARGV[6] and ARGV[6] ~= '' and ARGV[6] ~= '0') and ('dequeued:' .. ARGV[6]) or 'dequeued'
if (exists and redis.call('HSETNX', KEYS[2], marker, 1) == 1) or (not exists and ARGV[2] == '1') then
  if redis.call('HINCRBY', KEYS[1], 'requests', -1) < 0 then redis.call('HSET', KEYS[1], 'requests', 0) end
  if redis.call('HINCRBY', KEYS[1], 'tokens', -tonumber(ARGV[1])) < 0 then redis.call('HSET', KEYS[1], 'tokens', 0) end
end
"""

# DEADLINE_EXCEEDED's number, the status of a request whose deadline passed in the queue (its 'code'): its
# router ends it so when it reads that before its client's own deadline fires (before: UNAVAILABLE).
DEADLINE_CODE = str(grpc.StatusCode.DEADLINE_EXCEEDED.value[0])

# A prefill worker picks a job up. KEYS: admission hash, request hash. ARGV: prompt tokens,
# 1 if this is the job's first delivery, now, worker name, deadline (unix, 0 = none), the job's
# leg (RESUME_LUA). Returns "prefilling", "expired" (marked failed), "superseded" (the request has
# resumed past this job's leg: its counts returned), "local" (taken back by its router: its
# decode worker prefills it, and its router returns the counts, TAKE_BACK_LUA), "decoding" (a job
# claimed from a prefill worker that died after its handoff went through: this leg's decode
# worker has the KV, and said so: 'kv_leg', written with a 'decoding' that carries its leg,
# UPDATE_LUA; one of an older release sends none, and the job is prefilled again), or the
# final state / "" of a request that is no longer wanted.
PICKUP_LUA = (
    _IS_FINAL
    + "if tonumber(ARGV[6] or '0') < tonumber(redis.call('HGET', KEYS[2], 'resumed') or '0') then\n"
    + _LEAVE_QUEUE
    + "return 'superseded'\nend\n"
    + "if redis.call('HGET', KEYS[2], 'local') == '1' then return 'local' end\n"
    + _LEAVE_QUEUE
    + """
local state = redis.call('HGET', KEYS[2], 'state')
if not state or is_final(state) then
  return state or ''
end
if state == 'decoding' and tonumber(redis.call('HGET', KEYS[2], 'kv_leg') or '-1') == tonumber(ARGV[6] or '0') then
  return state
end
local deadline = tonumber(ARGV[5])
if deadline > 0 and deadline < tonumber(ARGV[3]) then
  redis.call('HSET', KEYS[2], 'state', 'failed', 'error', 'deadline exceeded in queue',
             'code', """
    + DEADLINE_CODE
    + """)
  return 'expired'
end
redis.call('HSET', KEYS[2], 'state', 'prefilling', 't_prefill_start', ARGV[3], 'prefill_worker', ARGV[4])
return 'prefilling'
"""
)

# A prefill worker drops a job it cannot read. KEYS: admission hash, the request hash (a key no
# request has when the id is unreadable). ARGV: the entry's 'tokens' as admission counted them
# (-1: the entry has none, so admission never counted it), 1 (a dropped entry is acked, so this
# is the only time it is seen), the error, and optionally the status code its client gets. Returns 1.
DROP_LUA = (
    "if ARGV[1] ~= '-1' then"
    + _LEAVE_QUEUE
    + """end
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('HSET', KEYS[2], 'state', 'failed', 'error', ARGV[3])
  if ARGV[4] then redis.call('HSET', KEYS[2], 'code', ARGV[4]) end
end
return 1
"""
)

# A prefill worker tops itself up: new jobs, one at a time and in priority order, until it
# holds ARGV[3] jobs or ARGV[4] more prompt tokens (the last job may pass the token room;
# the engine chunks it). One round trip for the whole top-up. KEYS: the streams, in the
# order to pull them. ARGV: group, consumer, job room, token room.
# Returns {stream, entry id, job json ('' if the entry has none), tokens ('' if none)} per entry.
PULL_LUA = """
local out = {}
local jobs, tokens = 0, 0
local max_jobs, max_tokens = tonumber(ARGV[3]), tonumber(ARGV[4])
for _, stream in ipairs(KEYS) do
  -- a departed worker's own stream is removed once empty (FORGET_STREAM_LUA): its group with it
  while jobs < max_jobs and tokens < max_tokens and redis.call('EXISTS', stream) == 1 do
    local got = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', 1, 'STREAMS', stream, '>')
    if not got then break end
    local entry = got[1][2][1]
    local fields = entry[2]
    local raw, n = '', ''  -- an entry without a job is returned too: the worker drops it
    for i = 1, #fields, 2 do
      if fields[i] == 'job' then raw = fields[i + 1] elseif fields[i] == 'tokens' then n = fields[i + 1] end
    end
    out[#out + 1] = {stream, entry[1], raw, n}
    local ok, job = pcall(cjson.decode, raw)  -- a malformed job counts 0 tokens
    if ok and type(job) == 'table' and type(job['token_ids']) == 'table' then
      tokens = tokens + #job['token_ids']
    end
    jobs = jobs + 1
  end
end
return out
"""

# A prefill worker's own stream (prefill affinity), made with its group when it is not there (a
# worker that comes back after its lease lapsed may find it removed), before each registry write:
# admission sends jobs there only while both are there. KEYS: the stream, the directed set.
# ARGV: group, worker id.
OWN_STREAM_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('XGROUP', 'CREATE', KEYS[1], ARGV[1], '0', 'MKSTREAM')
end
redis.call('SADD', KEYS[2], ARGV[2])
return 1
"""

# A prefill worker's own stream, once the worker has left the registry and the stream holds no
# entry (every job in it done and deleted), is removed. KEYS: the stream, the worker's registry
# entry, the directed set. ARGV: the worker id. Returns the entries left (0: removed), or -1 while
# the worker is registered.
FORGET_STREAM_LUA = """
if redis.call('EXISTS', KEYS[2]) == 1 then return -1 end
local n = redis.call('XLEN', KEYS[1])
if n == 0 then
  redis.call('DEL', KEYS[1])
  redis.call('SREM', KEYS[3], ARGV[1])
end
return n
"""

QUEUE_FIELDS = ("requests", "tokens")  # the admission hash: queued requests and prompt tokens, all routers together
LOCAL_FIELD = "local_tokens"  # ... and of those, the prompt tokens that their decode workers prefill


def queue_counts(values) -> tuple[int, int]:
    """(requests, tokens) from ``HMGET <admission> *QUEUE_FIELDS``; a missing field counts 0."""
    q, t = (int(x or 0) for x in values)
    return q, t


PRIORITY_CLASSES = ("high", "normal", "low")  # the order prefill workers pull in


def priority_class(priority: int) -> str:
    """Lower values are served first (vLLM's convention): < 0 high, 0 normal, > 0 low."""
    return "high" if priority < 0 else "low" if priority > 0 else "normal"


class Keys:
    def __init__(self, prefix: str):
        # A prefix with a hash tag of its own ("a{b}") is kept; any other is the tag: "{splitserve}".
        prefix = prefix if "{" in prefix and "}" in prefix.split("{", 1)[1] else "{" + prefix + "}"
        self.prefix = prefix
        self.stream = f"{prefix}:prefill"  # normal priority
        self.by_class = {c: self.stream if c == "normal" else f"{self.stream}:{c}" for c in PRIORITY_CLASSES}
        self.streams = tuple(self.by_class.values())  # in PRIORITY_CLASSES order: the order workers pull in
        self.admission = f"{prefix}:admission"
        self.routers = f"{prefix}:routers"
        self.prefix_records = f"{prefix}:prefix-records"  # routers' prefix records, shared (router/prefix_share.py)
        self.directed = f"{self.stream}:directed"  # the prefill workers with a stream of their own

    def stream_to(self, worker_id: str) -> str:
        """A prefill worker's own stream: the normal-priority jobs sent to it (prefill affinity)."""
        return f"{self.stream}:to:{worker_id}"

    def stream_for(self, priority: int) -> str:
        return self.by_class[priority_class(priority)]

    def req(self, request_id: str) -> str:
        return f"{self.prefix}:req:{request_id}"

    def router_requests(self, router_id: str) -> str:
        return f"{self.prefix}:router:{router_id}:requests"

    def worker(self, role: str, worker_id: str) -> str:
        return f"{self.prefix}:worker:{role}:{worker_id}"

    def worker_pattern(self, role: str) -> str:
        return f"{self.prefix}:worker:{role}:*"


def _real(lo: float, hi: float):
    return lambda v: type(v) in (int, float) and lo <= v < hi  # (NaN is in no range)


def _count(hi: int):
    return lambda v: type(v) is int and 0 <= v < hi


_UNIX_MAX = 1e10  # seconds: the year 2286 (a time made nanoseconds for a span fits in 64 bits)
# A job's fields as a router writes them: (check, what the field is). A value of another type or
# out of range, from a router of another release or a bug, failed the pickup's Redis script or a
# span's time, and a worker stopped pulling any job or died; the next to claim the job did too.
_JOB_FIELDS = {
    "request_id": (lambda v: isinstance(v, str) and 0 < len(v) <= 4096, "a request id"),
    "token_ids": (
        lambda v: isinstance(v, list) and len(v) > 0 and all(type(t) is int for t in v),
        "a list of token ids",
    ),
    "sampling": (lambda v: isinstance(v, dict), "an object"),
    **{
        name: (lambda v: isinstance(v, str), "a string")
        for name in ("decode_worker", "decode_address", "decode_host_id", "traceparent", "decode_epoch")
    },
    "cache_salt": (
        lambda v: isinstance(v, str) and len(v) <= CACHE_SALT_MAX_CHARS,
        f"a string of at most {CACHE_SALT_MAX_CHARS} characters",
    ),
    **{
        name: (_real(0, _UNIX_MAX), "a time (seconds since 1970)")
        for name in ("deadline_unix", "t_received", "t_admitted")
    },
    "priority": (lambda v: type(v) is int and -(2**31) <= v < 2**31, "an int32"),
    **{name: (_count(2**32), "a count") for name in ("decode_cached_tokens", "resumed", "resumed_chars", "leg")},
}


@dataclass
class Job:
    """A prefill job as it travels through the stream."""

    request_id: str
    token_ids: list[int]
    sampling: dict  # SamplingParams fields
    decode_worker: str
    decode_address: str
    decode_host_id: str
    deadline_unix: float  # 0 = none
    traceparent: str
    t_received: float
    t_admitted: float
    priority: int = 0  # < 0 high, 0 normal, > 0 low: picks the stream (Keys.stream_for)
    decode_epoch: str = ""  # the decode worker's run, as the router found it registered
    cache_salt: str = ""  # GenerateRequest.cache_salt
    # prefix affinity: the prompt tokens the router expects the decode worker to hold in its prefix
    # cache; the KV handed over leaves them out (KVHandle.start_token), as bytes or in the region
    decode_cached_tokens: int = 0
    # A request resumed after its decode worker was lost: the last `resumed` of token_ids are
    # completion tokens its client has (with `resumed_chars` characters of their text); the prompt
    # is the rest (LLMEngine.add_request)
    resumed: int = 0
    resumed_chars: int = 0
    leg: int = 0  # the request's resumes when it was queued (RESUME_LUA): an earlier leg's job is superseded

    @property
    def prompt_len(self) -> int:
        return len(self.token_ids) - self.resumed

    def to_json(self) -> str:
        # vars, not asdict: asdict deep-copies token_ids first (~0.2 ms at 300 tokens, on the TTFT path)
        return json.dumps(vars(self), separators=(",", ":"))

    @classmethod
    def from_dict(cls, d) -> Job:
        """A job from its decoded JSON. Fields this version does not know are ignored (a newer
        router may add some); ValueError if malformed."""
        if not isinstance(d, dict):
            raise ValueError(f"a job is a JSON object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        missing = sorted(f.name for f in fields(cls) if f.default is MISSING and f.name not in d)
        if missing:
            raise ValueError(f"job is missing {', '.join(missing)}")
        for name, (ok, what) in _JOB_FIELDS.items():  # each one a router writes as it writes it
            if name in d and not ok(d[name]):
                raise ValueError(f"job's {name} is not {what}")
        return cls(**{k: v for k, v in d.items() if k in known})

    def params(self) -> SamplingParams:
        """Sampling fields this version does not know are left out (a newer router may add some)."""
        known = {f.name for f in fields(SamplingParams)}
        d = {k: v for k, v in self.sampling.items() if k in known}  # (lists: SamplingParams checks and makes tuples)
        fmt = d.get("structured_output")
        if fmt is not None:
            if not (isinstance(fmt, dict) and isinstance(fmt.get("kind"), str)):
                raise ValueError("job's sampling.structured_output is not a format")
            d["structured_output"] = StructuredOutput(
                fmt["kind"], fmt.get("value", ""), bool(fmt.get("disable_any_whitespace", False))
            )
        return SamplingParams(**d)


def sampling_to_dict(p: SamplingParams) -> dict:
    d = asdict(p)
    d["stop"] = list(p.stop)
    d["stop_token_ids"] = list(p.stop_token_ids)
    return d


@dataclass
class WorkerInfo:
    worker_id: str
    role: str
    address: str
    host_id: str
    running: int = 0
    waiting: int = 0
    free_kv_tokens: int = 0
    kv_capacity_tokens: int = 0  # decode: the most tokens one sequence can ever hold here (0 = unknown)
    pending: int = 0  # decode: streams waiting for their KV
    # decode: streams opened and closed by this run (epoch) of the worker; opened - closed are open
    opened: int = 0
    closed: int = 0
    epoch: str = ""
    updated: float = 0.0
    metrics: str = ""  # host:port of its /metrics
    arena: str = ""  # prefill: its shared-memory arena (decode workers on its host map it ahead)

    def to_mapping(self) -> dict:
        return {k: str(v) for k, v in asdict(self).items()}

    @classmethod
    def from_mapping(cls, m: dict) -> WorkerInfo:
        """An entry as a worker writes it (to_mapping); ValueError naming the field for one that is
        not (a worker of another release, or a hand, may write any hash under the key)."""
        try:
            m = {
                (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
                for k, v in m.items()
            }
        except UnicodeDecodeError:
            raise ValueError("registry entry is not UTF-8") from None
        for name in ("worker_id", "role", "address", "host_id"):
            if not m.get(name):
                raise ValueError(f"registry entry has no {name}")
        counts = {name: _registry_count(m, name) for name in _REGISTRY_COUNTS}
        try:
            updated = float(m.get("updated", 0))
        except ValueError:
            updated = math.nan
        if not 0 <= updated < _UNIX_MAX:
            raise ValueError(f"registry entry's updated is not a time: {m.get('updated', '')[:40]!r}")
        return cls(
            worker_id=m["worker_id"],
            role=m["role"],
            address=m["address"],
            host_id=m["host_id"],
            **counts,
            epoch=m.get("epoch", ""),
            updated=updated,
            metrics=m.get("metrics", ""),
            arena=m.get("arena", ""),
        )


_REGISTRY_COUNTS = ("running", "waiting", "free_kv_tokens", "kv_capacity_tokens", "pending", "opened", "closed")


def _registry_count(m: dict, name: str) -> int:
    value = m.get(name, "0")
    try:
        n = int(value)
    except ValueError:
        n = -1
    if not 0 <= n < 2**63:
        raise ValueError(f"registry entry's {name} is not a count: {value[:40]!r}")
    return n


# A registry entry and its lease in one step: written apart (HSET, then PEXPIRE), a worker killed
# between the two, or a Redis Cluster pipeline, which has no transaction, could leave an entry
# without a lease, which routers would read as a live worker for good.
HEARTBEAT_LUA = """
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
"""


def registration(keys: Keys, info: WorkerInfo, lease_s: float) -> tuple[list[str], list[str]]:
    """HEARTBEAT_LUA's keys and args: this worker's registry entry, now, with a lease of lease_s."""
    info.updated = time.time()
    fields = [part for item in info.to_mapping().items() for part in item]
    return [keys.worker(info.role, info.worker_id)], [str(int(lease_s * 1000)), *fields]


def run_scripts(r, calls: list[tuple]) -> list:
    """Sync client: several registered scripts, each (script, keys, args), in one round trip.

    A pipeline of EVALSHA: redis-py's own pipelined scripts cost one more round trip (SCRIPT
    EXISTS) each time. A script the server has lost (it restarted) is loaded and run again, only
    that one: the others have run. Any other error is raised after all have been sent.
    A Redis Cluster client cannot pipeline EVALSHA: there they run one after another.
    """
    from redis.cluster import RedisCluster
    from redis.exceptions import NoScriptError

    if len(calls) == 1 or isinstance(r, RedisCluster):
        return [script(keys=keys, args=args) for script, keys, args in calls]

    with r.pipeline(transaction=False) as p:
        for script, keys, args in calls:
            p.evalsha(script.sha, len(keys), *keys, *args)
        results = p.execute(raise_on_error=False)
    out = []
    for (script, keys, args), result in zip(calls, results):
        if isinstance(result, NoScriptError):
            result = script(keys=keys, args=args)
        elif isinstance(result, Exception):
            raise result
        out.append(result)
    return out


def ensure_group(r, keys: Keys) -> None:
    import redis

    for stream in keys.streams:
        try:
            r.xgroup_create(stream, GROUP, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise


CLUSTER_MODES = ("auto", "on", "off")
# A call to a Redis that does not answer (stopped, its host lost) fails after this, as
# UNAVAILABLE for a client, instead of holding a request or a worker's loop until Redis is back.
# No call the stack makes blocks in Redis for longer (a prefill worker's pull: 0.2 s).
CALL_TIMEOUT_S = 5.0


def is_cluster(url: str, cluster: str = "auto") -> bool:
    """Whether `url` is a Redis Cluster node: `cluster` on or off says so; auto asks the server.
    A server that cannot be reached is taken as not a cluster (with a warning)."""
    if cluster not in CLUSTER_MODES:
        raise ValueError(f"redis_cluster must be one of {', '.join(CLUSTER_MODES)}, got {cluster!r}")
    if cluster != "auto":
        return cluster == "on"
    if url.startswith("unix://"):  # cluster nodes are reached over TCP: nothing to ask (the embedded Redis)
        return False
    import redis

    try:
        with redis.Redis.from_url(url, socket_timeout=CALL_TIMEOUT_S) as r:
            return bool(r.info("cluster").get("cluster_enabled"))
    except (redis.RedisError, OSError) as e:
        log.warning(
            "could not ask Redis at %s whether it is a cluster (%s): taken as not one; "
            "set SPLITSERVE_REDIS_CLUSTER=on for a cluster",
            url,
            e,
        )
        return False


def connect(url: str, cluster: str = "auto", *, asyncio: bool = False, **kwargs):
    """A client for the Redis at `url`, sync or asyncio: a cluster client for a Redis Cluster node
    (any node: it finds the others). `kwargs` go to the client (socket_timeout, ...)."""
    kwargs.setdefault("socket_timeout", CALL_TIMEOUT_S)
    if asyncio:  # redis-py writes each command under asyncio.wait_for, which loses cancels on 3.11
        from splitserve.service.aio import use_fixed_wait_for

        use_fixed_wait_for()
    if is_cluster(url, cluster):
        if asyncio:
            from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

            return AsyncRedisCluster.from_url(url, **kwargs)
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(url, **kwargs)
    if asyncio:
        import redis.asyncio as aioredis

        return aioredis.from_url(url, **kwargs)
    import redis

    return redis.Redis.from_url(url, **kwargs)


def now() -> float:
    return time.time()
