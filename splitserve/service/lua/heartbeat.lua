-- A registry entry and its lease in one step: written apart (HSET, then PEXPIRE), a worker killed
-- between the two, or a Redis Cluster pipeline, which has no transaction, could leave an entry
-- without a lease, which routers would read as a live worker for good.

redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
