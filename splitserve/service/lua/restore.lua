-- A prefill worker puts back the hash of a request it holds that Redis no longer has (it restarted
-- empty), so the request's router keeps waiting for it instead of ending it. Only where there is
-- no hash: one that exists, in whatever state, is left alone. KEYS[1] the request hash; ARGV: TTL,
-- then field, value, ...  Returns 1 if it put the hash back.

if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[1]))
return 1
