-- Admission, request hash and job in one atomic step: nothing is half-queued.
-- KEYS: admission, stream, request hash, the router's request set; for a request sent again
-- after it ended unfinished (a new attempt, under its own hash: attempt_id), also its first
-- attempt's hash and its latest attempt's.  ARGV: tokens, max_requests, max_tokens, fraction,
-- ttl, job json, queue the job (0: its decode worker prefills it itself, colocated or by conditional
-- disaggregation; its hash says 'local'), the router's id; for a new attempt, the attempts the
-- first hash counted when the router read it (another attempt admitted since: refused as -1);
-- with a client-chosen id, that count (0 for a first attempt) and the request's fingerprint,
-- which the hash keeps ('fingerprint': a retry must be the same request). Returns {admitted
-- (1, 0 refused, -1 the id exists, -2 an Abort for it came first: abort.lua), requests, tokens,
-- local_tokens}, the counts with this request when it was admitted.
-- Prefill affinity: ARGV[11] (ARGV[9] and [10] given, '' when unused) is a bound, and the last two
-- KEYS a prefill worker's own stream and its registry entry: the job goes to that stream, not
-- KEYS[2], while the worker is registered, its stream is there (its group with it) and holds fewer
-- entries than the bound (its jobs not yet done). Then a fifth value returned is 1.
-- ARGV[12] '1': a new attempt of a request its client sent again to go on (resume_from), having lost
-- its stream (its router went away): a latest attempt still running (not aborted) does not refuse
-- it but is superseded, marked failed ('superseded'), once this one is admitted.
-- ARGV[13], ARGV[14]: a tenant's quotas (its queued requests, its queued tokens; '' or 0: none),
-- checked against its own counts (tenant_counts) before the stack's bounds: over one, it is
-- refused as -3, returning {-3, its requests, its tokens, 0}.
-- include: may_run_again
-- include: is_final
-- include: tenant_counts

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
local tenant = string.match(KEYS[3], ':req:([^~]+)~')
if tenant then
  local tq = tonumber(redis.call('HGET', KEYS[1], 'requests@' .. tenant) or '0')
  local tt = tonumber(redis.call('HGET', KEYS[1], 'tokens@' .. tenant) or '0')
  local mq, mt = tonumber(ARGV[13] or '0') or 0, tonumber(ARGV[14] or '0') or 0
  if (mq > 0 and tq + 1 > mq) or (mt > 0 and tt + n > mt) then
    return {-3, tq, tt, 0}
  end
end
local frac = tonumber(ARGV[4])
if q + 1 > math.floor(tonumber(ARGV[2]) * frac) or t + n > math.floor(tonumber(ARGV[3]) * frac) then
  return {0, q, t, lt}
end
redis.call('HINCRBY', KEYS[1], 'requests', 1)
redis.call('HINCRBY', KEYS[1], 'tokens', n)
tenant_add(KEYS[1], KEYS[3], 1, n)
local job = cjson.decode(ARGV[6])
-- prompt_tokens: the prompt's (a job's tokens may end with completion tokens its client has: resumed);
-- queued_tokens: all it counts in the queue, returned once (a local one's by reap.lua)
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
