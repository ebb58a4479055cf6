-- A prefill worker's own stream, once the worker has left the registry and the stream holds no
-- entry (every job in it done and deleted), is removed. KEYS: the stream, the worker's registry
-- entry, the directed set. ARGV: the worker id. Returns the entries left (0: removed), or -1 while
-- the worker is registered.

if redis.call('EXISTS', KEYS[2]) == 1 then return -1 end
local n = redis.call('XLEN', KEYS[1])
if n == 0 then
  redis.call('DEL', KEYS[1])
  redis.call('SREM', KEYS[3], ARGV[1])
end
return n
