-- A request its decode worker prefills (colocated, or by conditional disaggregation) leaves the
-- queue at its first token or its end: its router returns the counts then, or, if that router
-- went away, reap.lua does. Exactly once: the request hash remembers it ('dequeued'); a hash that
-- is gone (expired, or Redis restarted empty) returns them, never below zero.
local function leave_local(admission, req, n)
  if redis.call('EXISTS', req) == 1 and redis.call('HSETNX', req, 'dequeued', 1) == 0 then return 0 end
  for _, f in ipairs({'requests', 'tokens', 'local_tokens'}) do
    if redis.call('HINCRBY', admission, f, f == 'requests' and -1 or -n) < 0 then
      redis.call('HSET', admission, f, 0)
    end
  end
  tenant_add(admission, req, -1, -n)
  return 1
end
