-- Leaving the queue returns a job's admission counts exactly once. The request hash remembers
-- it ('dequeued'), so a job claimed from a worker that died between pulling and picking it up
-- still returns them, and one picked up before that worker died does not return them twice.
-- A hash that is gone (expired) falls back to the delivery: only a first delivery returns them.
-- The counts never go below zero (a job picked up by a worker of an older version, which left
-- no marker, and then claimed, would otherwise be returned twice).
-- Each leg of a resumed request (resume.lua) has a marker of its own ('dequeued:<leg>').
-- admission: the admission hash; req: the request hash; tokens: the job's prompt tokens;
-- first_delivery: '1' on the job's first delivery; leg: the job's leg (nil, '' or '0': the first).
local function leave_queue(admission, req, tokens, first_delivery, leg)
  local exists = redis.call('EXISTS', req) == 1
  local marker = (leg and leg ~= '' and leg ~= '0') and ('dequeued:' .. leg) or 'dequeued'
  if (exists and redis.call('HSETNX', req, marker, 1) == 1) or (not exists and first_delivery == '1') then
    if redis.call('HINCRBY', admission, 'requests', -1) < 0 then redis.call('HSET', admission, 'requests', 0) end
    if redis.call('HINCRBY', admission, 'tokens', -tonumber(tokens)) < 0 then redis.call('HSET', admission, 'tokens', 0) end
    tenant_add(admission, req, -1, -tonumber(tokens))
  end
end
