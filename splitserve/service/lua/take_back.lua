-- A router takes a request back from the prefill queue (no prefill worker is registered: they
-- died, or hang) for its decode worker to prefill: only one still queued and not picked up (a
-- pickup and a take-back exclude each other). It is then counted as a request its decode worker
-- prefills, admitted so (admit.lua): it leaves the queue at its first token (dequeue.lua), and a
-- prefill worker that pulls its job skips it (pickup.lua). KEYS: admission hash, request hash.
-- ARGV: prompt tokens, now. Returns 1 if it took it back.

local got = redis.call('HMGET', KEYS[2], 'state', 'local', 'dequeued')
if got[1] ~= 'queued' or got[2] == '1' or got[3] then return 0 end
redis.call('HSET', KEYS[2], 'local', 1, 't_taken_back', ARGV[2])
redis.call('HINCRBY', KEYS[1], 'local_tokens', tonumber(ARGV[1]))
return 1
