-- A running request's progress, written by its router every half heartbeat so that GetRequest
-- on any router shows it before its end (when the end's write sets them for good). KEYS: request
-- hashes (one slot: the prefix's hash tag); ARGV: for each, its completion tokens so far and the
-- unix time of its first token. A hash that is gone or ended is left alone: a count read before a
-- request's end must not overwrite the one its end wrote, nor bring back an expired hash.
-- include: is_final

local n = 0
for i, key in ipairs(KEYS) do
  local state = redis.call('HGET', key, 'state')
  if state and not is_final(state) then
    redis.call('HSET', key, 'completion_tokens', ARGV[2 * i - 1], 't_first_token', ARGV[2 * i])
    n = n + 1
  end
end
return n
