-- A prefill worker tops itself up: new jobs, one at a time and in priority order, until it
-- holds ARGV[3] jobs or ARGV[4] more prompt tokens (the last job may pass the token room;
-- the engine chunks it). One round trip for the whole top-up. KEYS: the streams, in the
-- order to pull them. ARGV: group, consumer, job room, token room.
-- Returns {stream, entry id, job json ('' if the entry has none), tokens ('' if none)} per entry.

local out = {}
local jobs, tokens = 0, 0
local max_jobs, max_tokens = tonumber(ARGV[3]), tonumber(ARGV[4])
for _, stream in ipairs(KEYS) do
  -- a departed worker's own stream is removed once empty (forget_stream.lua): its group with it
  while jobs < max_jobs and tokens < max_tokens and redis.call('EXISTS', stream) == 1 do
    local got = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', 1, 'STREAMS', stream, '>')
    if not got then break end
    local entry = got[1][2][1]
    local fields = entry[2]
    local raw, n = '', ''  -- an entry without a job is returned too: the worker drops it
    for i = 1, #fields, 2 do
      if fields[i] == 'job' then raw = fields[i + 1] elseif fields[i] == 'tokens' then n = fields[i + 1] end
    end
    out[#out + 1] = {stream, entry[1], raw, n}
    local ok, job = pcall(cjson.decode, raw)  -- a malformed job counts 0 tokens
    if ok and type(job) == 'table' and type(job['token_ids']) == 'table' then
      tokens = tokens + #job['token_ids']
    end
    jobs = jobs + 1
  end
end
return out
