-- in flight (attempt n) -> pending (attempt n - 1: no attempt spent). For pushes the
-- recipient never saw (unreachable, handshake refused) and a broker shutting down:
-- queue ones to the head of the ready list, topic copies due at once.
-- KEYS: msgs, state, ready, delayed, inflight
-- ARGV: delivery ids. Returns 1 (released) or 0 (not in flight) each.
local msgs, state, ready, delayed, inflight = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
return each_id(1, function(id)
  if redis.call('ZREM', inflight, id) == 0 then return false end
  local msgid, crid = split(id)
  if redis.call('HEXISTS', msgs, msgid) == 1 then
    redis.call('HINCRBY', state, field(msgid, 'n', crid), -1)
    redis.call('HDEL', state, field(msgid, 'l', crid))
    if crid then
      redis.call('ZADD', delayed, 0, id)
    else
      redis.call('LPUSH', ready, id)
    end
  end
  return true
end)
