-- dead -> gone, for one consumer group: an operator's purge of the group's dead letters
-- (not dead: refused); the group log may then drop the entry.
-- KEYS, ARGV: as pull_lib.lua, then entry id*. Returns 1 (purged) or 0 each.
local out = {}
for i = rest, #ARGV do
  local id = ARGV[i]
  if redis.call('ZREM', dead, id) == 1 then
    redis.call('ZREM', held, id)
    forget_entry(id)
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
