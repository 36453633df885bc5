-- dead -> delayed (due now): replayed, attempts reset, its TTL (if any) lifted: an
-- operator's replay is a deliberate new try. Anything not dead is refused.
-- KEYS: state, delayed, dead
-- ARGV: now, then delivery ids. Returns 1 (replayed) or 0 (not dead) each.
local state, delayed, dead = KEYS[1], KEYS[2], KEYS[3]
local now = tonumber(ARGV[1])
return each_id(2, function(id)
  if redis.call('ZREM', dead, id) == 0 then return false end
  local msgid, crid = split(id)
  redis.call('HSET', state, field(msgid, 'n', crid), 0)
  redis.call('HDEL', state, field(msgid, 'x'), field(msgid, 'l', crid))
  if crid then
    redis.call('HINCRBY', state, field(msgid, 'dc'), -1)
    redis.call('HINCRBY', state, field(msgid, 'o'), 1)
  end
  redis.call('ZADD', delayed, now, id)
  return true
end)
