-- in flight (attempt n) -> acked. Only while in flight, and only the attempt named (a
-- late ack for attempt 1 must not settle attempt 2, perhaps another broker's): a
-- delayed, pending, retry-waiting or dead message cannot be acked.
-- The next message of its ordering key (if any) may go.
-- KEYS: msgs, state, inflight, ready, delayed, kq, done:<current bucket>
-- ARGV: now, done ttl ms, then (delivery id, attempt or 0 for the current)*
-- Returns (ok, attempt, stored ms, recipient, 1 if it let the next message of its key go
-- else 0)*.
-- The batch's reads (attempt, recipient, key and copies fields; the messages; the
-- leases) are one call each, and so are its writes (the leases dropped, the acked
-- messages dropped, SADD).
local msgs, state, inflight, ready, delayed = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local kq, done = KEYS[6], KEYS[7]
local now = tonumber(ARGV[1])
local ids, fields, msgids, crids = {}, {}, {}, {}  -- (crids[j]: false for a queue message)
for i = 3, #ARGV, 2 do
  ids[#ids + 1] = ARGV[i]
  local msgid, crid = split(ARGV[i])
  fields[#fields + 1] = field(msgid, 'n', crid)
  fields[#fields + 1] = field(msgid, 'r')
  fields[#fields + 1] = field(msgid, 'k')
  fields[#fields + 1] = field(msgid, 'c')
  msgids[#msgids + 1] = msgid
  crids[#msgids] = crid or false
end
local f = call_all('HMGET', state, fields)
local stored = call_all('HMGET', msgs, msgids)
local leased = call_all('ZMSCORE', inflight, ids)
local dropped, forgotten, acked, settled = {}, {}, {}, {}
local out = {}
for j = 1, #msgids do
  local id = ids[j]
  local want = tonumber(ARGV[2 + 2 * j])
  local msgid, crid = msgids[j], crids[j]
  local at = 4 * j - 3
  -- (an id acked earlier in this batch: its lease and its attempt field are gone)
  local n = acked[id] and 0 or tonumber(f[at] or '0')
  local m = false
  if (want == 0 or want == n) and leased[j] and not acked[id] then
    settled[#settled + 1] = id  -- (the lease goes even if its message is gone)
    m = stored[j]
  end
  if not m then
    out[#out + 1] = 0; out[#out + 1] = n; out[#out + 1] = 0; out[#out + 1] = ''
    out[#out + 1] = 0
  else
    acked[id] = true
    local released = 0
    if not crid or settle_copy(state, msgid, crid, 'o') then
      if advance(state, kq, ready, delayed, msgid, now, f[at + 2]) then released = 1 end
      state_fields(dropped, state, msgid, f[at + 3])
      forgotten[#forgotten + 1] = msgid
    end
    local _, at_ms = read_message(m, now)
    out[#out + 1] = 1; out[#out + 1] = n; out[#out + 1] = at_ms
    out[#out + 1] = crid or f[at + 1] or ''; out[#out + 1] = released
  end
end
if #settled > 0 then call_all('ZREM', inflight, settled) end
if #forgotten > 0 then
  call_all('HDEL', state, dropped)
  call_all('HDEL', msgs, forgotten)
  call_all('SADD', done, forgotten)
  redis.call('PEXPIRE', done, tonumber(ARGV[2]))
end
return out
