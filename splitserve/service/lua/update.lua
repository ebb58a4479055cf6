-- A worker records progress on a request: only on a hash that exists (one that expired, or that a
-- Redis restarted empty lost, is not recreated without a TTL), and never moving a request out of
-- a final state (a late "decoding" must not hide "cancelled"). KEYS[1] the request hash; ARGV
-- field, value, ...; a pair ('_leg', n) says it is of leg n (resume.lua): a job's, or a decode
-- stream's: nothing is written once the request has resumed past it (a job superseded, a decode
-- worker taken for lost that adopts the KV late: their state, worker and times are not the new
-- leg's); a 'decoding' written with its leg records it ('kv_leg', which pickup.lua reads).
-- Returns 1 if the hash exists.
-- include: is_final

local got = redis.call('HMGET', KEYS[1], 'state', 'resumed')
local state = got[1]
if not state then return 0 end
local final = is_final(state)
local leg = nil
for i = 1, #ARGV, 2 do
  if ARGV[i] == '_leg' then
    if tonumber(ARGV[i + 1]) < tonumber(got[2] or '0') then return 1 end
    leg = ARGV[i + 1]
  end
end
local args = {}
for i = 1, #ARGV, 2 do
  if ARGV[i] ~= '_leg' and not (final and (ARGV[i] == 'state' or ARGV[i] == 'error' or ARGV[i] == 'code'
                                            or ARGV[i] == 'lost_to')) then
    args[#args + 1] = ARGV[i]
    args[#args + 1] = ARGV[i + 1]
    if leg and ARGV[i] == 'state' and ARGV[i + 1] == 'decoding' then
      args[#args + 1] = 'kv_leg'
      args[#args + 1] = leg
    end
  end
end
if #args > 0 then redis.call('HSET', KEYS[1], unpack(args)) end
return 1
