-- A request whose decode worker was lost resumes: its prompt and the tokens its client has go to a
-- prefill worker again (or to its new decode worker, which prefills them), unless it has ended
-- meanwhile (an Abort, a worker's failure) or the queue is full (its bounds themselves: the
-- request has been admitted once). Each resume is a leg ('resumed' counts them; the job carries
-- its number, Job.leg): a job of an earlier leg, still queued or prefilling for the lost worker,
-- is superseded (pickup.lua skips it, returning its own counts; update.lua ignores its failure).
-- The new job's counts come back at its pickup, under its leg's marker. KEYS: admission hash, the
-- stream for its priority, the request hash. ARGV: tokens to prefill, the bounds (requests,
-- tokens), the request TTL, the job, 1 to queue it (0: its decode worker prefills it), the lost
-- worker's id. Returns {1 | 0 (the queue is full) | -2 (it has ended), requests queued, tokens
-- queued}. A request a prefill worker failed because it could not reach that worker ('lost_to':
-- its handoff broke as the worker was lost, recorded before its router saw the loss) resumes.
-- include: is_final
-- include: tenant_counts

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
  tenant_add(KEYS[1], KEYS[3], 1, n)
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
