-- A recipient registered (again): alive from now on. Sets the app's `listed` mark (see
-- forget.lua); the store then lists the app in the apps directory.
-- KEYS: recipients, rstate, rbeat, listed
-- ARGV: rid, registration JSON, now
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[1], 1)
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
redis.call('SET', KEYS[4], 1)
return 1
