-- A recipient registered (again): alive from now on.
-- KEYS: recipients, rstate, rbeat
-- ARGV: rid, registration JSON, now
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[1], 1)
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
return 1
