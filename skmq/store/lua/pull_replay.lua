-- dead -> delayed (due now, attempts reset, TTL lifted), for one consumer group: an
-- operator's replay of the group's dead letters (not dead: refused). Waiting receives wake.
-- Attempts start again from the replay (`b`), receipts go on counting (`n`).
-- KEYS, ARGV: as pull_lib.lua, then entry id*. Returns 1 (replayed) or 0 each.
local out = each_dead(function(id)
  not_plain()
  redis.call('HSET', gstate, bfield(id), redis.call('HGET', gstate, nfield(id)) or 0)
  redis.call('HDEL', gstate, efield(id))
  redis.call('HSET', gstate, tfield(id), 1)
  redis.call('ZADD', delayed, now, id)
end)
redis.call('PUBLISH', glog, now)
return out
