-- in flight (attempt n, lease running) -> acked, for one consumer group. A receipt of an
-- earlier attempt, or whose lease ran out, is refused: it never settles a redelivery.
-- KEYS, ARGV: as pull_lib.lua, then (entry id, attempt)*. Returns 1 (acked) or 0 each.
local out = {}
for i = rest, #ARGV, 2 do
  local id = ARGV[i]
  if live(id, tonumber(ARGV[i + 1])) then
    redis.call('ZREM', inflight, id)
    redis.call('ZREM', held, id)
    redis.call('HDEL', gstate, nfield(id), efield(id))
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
