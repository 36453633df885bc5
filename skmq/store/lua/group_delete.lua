-- A consumer group unsubscribes: its cursor and every key of it go.
-- KEYS: as pull_lib.lua. ARGV: group. Returns 1, or 0 (no such group).
redis.call('DEL', KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8])
return redis.call('HDEL', KEYS[1], ARGV[1])
