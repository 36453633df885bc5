-- dead -> delayed (due now): replayed, attempts reset. Anything not dead is refused.
-- KEYS: state, delayed, dead
-- ARGV: now, then delivery ids. Returns 1 (replayed) or 0 (not dead) each.
local state, delayed, dead = KEYS[1], KEYS[2], KEYS[3]
local now = tonumber(ARGV[1])
local out = {}
for i = 2, #ARGV do
  local id = ARGV[i]
  if redis.call('ZREM', dead, id) == 1 then
    local msgid, crid = split(id)
    redis.call('HSET', state, field(msgid, 'n', crid), 0)
    if crid then
      redis.call('HINCRBY', state, field(msgid, 'dc'), -1)
      redis.call('HINCRBY', state, field(msgid, 'o'), 1)
    end
    redis.call('ZADD', delayed, now, id)
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
