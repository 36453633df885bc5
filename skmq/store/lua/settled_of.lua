-- No transition: whether deliveries whose finish's answer was lost were acked: no
-- longer in flight, waiting or dead, and their message completed since (its msgid in
-- the dedupe set), or, for a topic copy, settled while the message is still held.
-- KEYS: msgs, inflight, delayed, dead, done:<current bucket>, done:<previous bucket>
-- ARGV: delivery ids. Returns 1 (acked) or 0 each.
local msgs, inflight, delayed, dead = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local cur, prev = KEYS[5], KEYS[6]
local out = {}
for i = 1, #ARGV do
  local id = ARGV[i]
  local msgid, crid = split(id)
  local acked = 0
  if not (redis.call('ZSCORE', inflight, id) or redis.call('ZSCORE', delayed, id)
          or redis.call('ZSCORE', dead, id)) then
    if redis.call('HEXISTS', msgs, msgid) == 1 then
      if crid then acked = 1 end
    elseif redis.call('SISMEMBER', cur, msgid) == 1
        or redis.call('SISMEMBER', prev, msgid) == 1 then
      acked = 1
    end
  end
  out[i] = acked
end
return out
