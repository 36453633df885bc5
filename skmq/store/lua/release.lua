-- in flight (attempt n) -> pending (attempt n - 1: no attempt spent). For pushes the
-- recipient never saw (unreachable, handshake refused) and a broker shutting down:
-- queue ones to the head of the ready list, topic copies due at once. Only the attempt
-- named (0: whichever, for a dead process's leases): a broker that stalled past its
-- lease must not hand back a message another broker has pushed again since.
-- KEYS: msgs, state, ready, delayed, inflight
-- ARGV: (delivery id, attempt or 0)*. Returns 1 (released) or 0 (not in flight, or in
-- flight as another attempt) each.
local msgs, state, ready, delayed, inflight = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local out = {}
for i = 1, #ARGV, 2 do
  local id, attempt = ARGV[i], tonumber(ARGV[i + 1])
  local msgid, crid = split(id)
  local n = field(msgid, 'n', crid)
  local ours = attempt == 0 or tonumber(redis.call('HGET', state, n) or '0') == attempt
  if ours and redis.call('ZREM', inflight, id) == 1 then
    if redis.call('HEXISTS', msgs, msgid) == 1 then
      redis.call('HINCRBY', state, n, -1)
      redis.call('HDEL', state, field(msgid, 'l', crid))
      if crid then
        redis.call('ZADD', delayed, 0, id)
      else
        redis.call('LPUSH', ready, id)
      end
    end
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
