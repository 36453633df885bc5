-- A recipient registered (again): alive from now on. Sets the app's `listed` mark (see
-- forget.lua); the store then lists the app in the apps directory. A new recipient of an
-- app that has `max` already is refused (MAX_RECIPIENTS_PER_APP).
-- KEYS: recipients, rstate, rbeat, listed
-- ARGV: rid, registration JSON, now, max
-- Returns 1 (registered) or 0 (refused).
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0
    and redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[4]) then
  return 0
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[1], 1)
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
redis.call('SET', KEYS[4], 1)
return 1
