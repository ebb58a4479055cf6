-- A prefill worker's own stream (prefill affinity), made with its group when it is not there (a
-- worker that comes back after its lease lapsed may find it removed), before each registry write:
-- admission sends jobs there only while both are there. KEYS: the stream, the directed set.
-- ARGV: group, worker id.

if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('XGROUP', 'CREATE', KEYS[1], ARGV[1], '0', 'MKSTREAM')
end
redis.call('SADD', KEYS[2], ARGV[2])
return 1
