-- A prefill worker picks a job up. KEYS: admission hash, request hash. ARGV: prompt tokens,
-- 1 if this is the job's first delivery, now, worker name, deadline (unix, 0 = none), the job's
-- leg (resume.lua). Returns "prefilling", "expired" (marked failed), "superseded" (the request has
-- resumed past this job's leg: its counts returned), "local" (taken back by its router: its
-- decode worker prefills it, and its router returns the counts, take_back.lua), "decoding" (a job
-- claimed from a prefill worker that died after its handoff went through: this leg's decode
-- worker has the KV, and said so: 'kv_leg', written with a 'decoding' that carries its leg,
-- update.lua; one of an older release sends none, and the job is prefilled again), or the
-- final state / "" of a request that is no longer wanted.
-- include: is_final
-- include: tenant_counts
-- include: leave_queue

if tonumber(ARGV[6] or '0') < tonumber(redis.call('HGET', KEYS[2], 'resumed') or '0') then
  leave_queue(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[6])
  return 'superseded'
end
if redis.call('HGET', KEYS[2], 'local') == '1' then return 'local' end
leave_queue(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[6])
local state = redis.call('HGET', KEYS[2], 'state')
if not state or is_final(state) then
  return state or ''
end
if state == 'decoding' and tonumber(redis.call('HGET', KEYS[2], 'kv_leg') or '-1') == tonumber(ARGV[6] or '0') then
  return state
end
local deadline = tonumber(ARGV[5])
if deadline > 0 and deadline < tonumber(ARGV[3]) then
  -- 4: grpc.StatusCode.DEADLINE_EXCEEDED (redis_scripts.DEADLINE_CODE; a test checks they agree)
  redis.call('HSET', KEYS[2], 'state', 'failed', 'error', 'deadline exceeded in queue', 'code', 4)
  return 'expired'
end
redis.call('HSET', KEYS[2], 'state', 'prefilling', 't_prefill_start', ARGV[3], 'prefill_worker', ARGV[4])
return 'prefilling'
