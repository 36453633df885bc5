-- in flight (attempt n) -> acked. Only while in flight, and only the attempt named (a
-- late ack for attempt 1 must not settle attempt 2, perhaps another broker's): a
-- delayed, pending, retry-waiting or dead message cannot be acked.
-- The next message of its ordering key (if any) may go.
-- KEYS: msgs, state, inflight, ready, delayed, kq, done:<current bucket>
-- ARGV: now, done ttl ms, then (delivery id, attempt or 0 for the current)*
-- Returns (ok, attempt, stored ms, recipient)*.
local msgs, state, inflight, ready, delayed = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local kq, done = KEYS[6], KEYS[7]
local now = tonumber(ARGV[1])
local added = false
local out = {}
for i = 3, #ARGV, 2 do
  local id = ARGV[i]
  local want = tonumber(ARGV[i + 1])
  local msgid, crid = split(id)
  -- (its key and copies fields read now too: one call, not three)
  local f = redis.call('HMGET', state, field(msgid, 'n', crid), field(msgid, 'r'),
                       field(msgid, 'k'), field(msgid, 'c'))
  local n = tonumber(f[1] or '0')
  local m = false
  if (want == 0 or want == n) and redis.call('ZREM', inflight, id) == 1 then
    m = redis.call('HGET', msgs, msgid)
  end
  if not m then
    out[#out + 1] = 0; out[#out + 1] = n; out[#out + 1] = 0; out[#out + 1] = ''
  else
    if not crid or settle_copy(state, msgid, crid, 'o') then
      advance(state, kq, ready, delayed, msgid, now, f[3])
      forget(msgs, state, msgid, f[4])
      redis.call('SADD', done, msgid)
      added = true
    end
    out[#out + 1] = 1; out[#out + 1] = n; out[#out + 1] = tonumber(string.sub(m, 2, 14))
    out[#out + 1] = crid or f[2] or ''
  end
end
if added then redis.call('PEXPIRE', done, tonumber(ARGV[2])) end
return out
