-- Abort marks a request cancelled, in one step with reading its state, so a request that has
-- just ended keeps its final state. One that has not arrived yet (its Abort overtook its
-- Generate, through another router) gets a hash that says so ('early'), for the early TTL:
-- admitted within it, it is refused as cancelled (admit.lua). An aborted request is marked so
-- ('aborted'): its request_id is not run again. KEYS[1] the request hash; ARGV:
-- now, the TTL after completion, the early TTL. Returns {the state it had ('' when there is no
-- such request), its decode worker's id}.
-- include: is_final

local got = redis.call('HMGET', KEYS[1], 'state', 'decode_worker', 'early')
local state = got[1]
if not state or got[3] == '1' then
  redis.call('HSET', KEYS[1], 'state', 'cancelled', 'early', 1, 't_finished', ARGV[1])
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
  return {'', ''}
end
if not is_final(state) then
  redis.call('HSET', KEYS[1], 'state', 'cancelled', 'aborted', 1, 't_finished', ARGV[1])
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[2]))
elseif state ~= 'finished' then  -- it had failed or been cancelled: the Abort says not to run it again
  redis.call('HSET', KEYS[1], 'aborted', 1)
end
return {state, got[2] or ''}
