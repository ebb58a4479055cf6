-- A router that stopped heartbeating (killed, its host lost) left requests it can no longer
-- answer: each that has not ended is marked failed, so GetRequest tells the truth and a prefill
-- worker skips the ones still queued (or drops them between forwards). Only if the router is
-- still past its lease (unless forced: a router reaps its own id at start and stop), so one
-- that came back keeps its requests. The queue counts of its requests that their decode workers
-- prefill (which their router returns) are returned here, once. KEYS: the routers set, the
-- router's request set, the admission hash, then its request hashes. ARGV: router id, now, TTL
-- after completion, 1 to force. Returns how many requests it marked.
-- include: is_final
-- include: tenant_counts
-- include: leave_local

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
