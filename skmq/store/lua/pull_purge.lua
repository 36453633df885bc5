-- dead -> gone, for one consumer group: an operator's purge of the group's dead letters
-- (not dead: refused); the group log may then drop the entry.
-- KEYS, ARGV: as pull_lib.lua, then entry id*. Returns 1 (purged) or 0 each.
return each_dead(function(id)
  redis.call('ZREM', held, id)
  forget_entry(id)
end)
