-- Dead letters removed for good.
-- KEYS: dead letters (hash), by time (zset), dead topic copies by msgid (hash: lib.lua)
-- ARGV: delivery ids. Returns 1 (purged) or 0 (not a dead letter) each.
local out = {}
for i = 1, #ARGV do
  out[i] = redis.call('HDEL', KEYS[1], ARGV[i])
  redis.call('ZREM', KEYS[2], ARGV[i])
  if out[i] == 1 then count_dead(KEYS[3], ARGV[i], -1) end
end
return out
