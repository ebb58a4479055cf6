-- A prefill worker drops a job it cannot read. KEYS: admission hash, the request hash (a key no
-- request has when the id is unreadable). ARGV: the entry's 'tokens' as admission counted them
-- (-1: the entry has none, so admission never counted it), 1 (a dropped entry is acked, so this
-- is the only time it is seen), the error, and optionally the status code its client gets. Returns 1.
-- include: tenant_counts
-- include: leave_queue

if ARGV[1] ~= '-1' then
  leave_queue(KEYS[1], KEYS[2], ARGV[1], ARGV[2], nil)
end
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('HSET', KEYS[2], 'state', 'failed', 'error', ARGV[3])
  if ARGV[4] then redis.call('HSET', KEYS[2], 'code', ARGV[4]) end
end
return 1
