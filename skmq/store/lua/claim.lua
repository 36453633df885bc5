-- pending | delayed | waiting retry -> in flight (attempt n + 1), or -> dead when no
-- recipient can take the content. Also pending | delayed | waiting retry -> dead | gone:
-- a message whose TTL ran out is never pushed: dead-lettered (reason `expired`), or
-- dropped when drop is 1.
-- A message that dies or expires here lets the next message of its ordering key go.
-- KEYS: msgs, state, ready, delayed, inflight, dead, rate, kq
-- ARGV: now, lease ms, n, k, rate, drop 0|1, lost wait ms, l,
--       (alive rid, free slots, length 0|1) * k, lost rid * l, queue assignment rid * n
-- Takes up to n messages, due ones first, then the ready list. With a rate
-- (DELIVERY_RATE, pushes/s for the app, whichever brokers push) a token bucket holding
-- a tenth of a second's burst caps the pushes. A topic copy goes in flight only while
-- its recipient has a free window slot (PUSH_WINDOW holds for topics too); the others
-- wait in `delayed`, those of a lost recipient (registered, not alive: it gets no push
-- until it is back) for the lost wait, spending no attempt. Content holding CR or LF
-- needs `length=`: it goes only to a recipient that declared the `length` capability,
-- else it is dead-lettered.
-- Returns (delivery id, kind q|t|d|x, content, attempt, rid, stored ms, traceparent)* (kind d:
-- dead-lettered here, the content then being the reason; x: expired here, the content
-- then `dead` or `drop`), the next due ms (-1: none), and the ms until the
-- bucket has a token again (0: not limited).
local msgs, state, ready, delayed = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local inflight, dead, ratek, kq = KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local now = tonumber(ARGV[1])
local lease = now + tonumber(ARGV[2])
local n = tonumber(ARGV[3])
local k = tonumber(ARGV[4])
local rate = tonumber(ARGV[5])
local drop = ARGV[6] == '1'
local lost_wait = tonumber(ARGV[7])
local alive, budget, can_length, lost = {}, {}, {}, {}
for j = 1, k do
  local rid = ARGV[6 + 3 * j]
  alive[j] = rid
  budget[rid] = tonumber(ARGV[7 + 3 * j])
  can_length[rid] = ARGV[8 + 3 * j] == '1'
end
local qi = 9 + 3 * k
for j = 1, tonumber(ARGV[8]) do
  lost[ARGV[qi]] = true
  qi = qi + 1
end
local tokens = 0
if rate > 0 then
  local burst = math.max(1, rate / 10)
  local st = redis.call('HMGET', ratek, 't', 'ts')
  tokens = tonumber(st[1] or burst)
  tokens = math.min(burst, tokens + (now - tonumber(st[2] or now)) * rate / 1000)
  if n > math.floor(tokens) then n = math.floor(tokens) end
end
local out = {}
local pushed = 0
local stored = 0
local trace = ''
local function emit(id, kind, content, a, rid)
  out[#out + 1] = id; out[#out + 1] = kind; out[#out + 1] = content
  out[#out + 1] = a; out[#out + 1] = rid; out[#out + 1] = stored; out[#out + 1] = trace
end
local function needs_length(content) return string.find(content, '[\r\n]') ~= nil end
local function capable()
  for j = 1, k do if can_length[alive[j]] then return alive[j] end end
  return nil
end
local UNDELIVERABLE = 'undeliverable: content holds CR or LF and no recipient declared '
  .. 'the length capability'
local function bury(id, msgid, crid, rid)
  if not crid then advance(state, kq, ready, delayed, msgid, now) end
  note(state, msgid, crid, now .. ' attempt=0 recipient=' .. rid .. ' ' .. UNDELIVERABLE,
       UNDELIVERABLE)
  redis.call('ZADD', dead, now, id)
  emit(id, 'd', UNDELIVERABLE, 0, rid)
end
-- Writes wait in `sets` (state fields) and `leases` (inflight) for one call each at
-- the end, or before a rare path (expiry, burial) that writes the same fields.
local sets, leases = {}, {}
local function write_out()
  if #sets > 0 then call_all('HSET', state, sets); sets = {} end
  if #leases > 0 then call_all('ZADD', inflight, leases); leases = {} end
end
-- The next attempt of a delivery: `known`, its attempt field as prefetched (false: none),
-- unless this claim wrote it since.
local attempts = {}
local function next_attempt(msgid, crid, known)
  local nf = field(msgid, 'n', crid)
  local a = (attempts[nf] or tonumber(known or '0')) + 1
  attempts[nf] = a
  sets[#sets + 1] = nf; sets[#sets + 1] = a
  return a
end
local function lease_copy(cid, msgid, crid, content, known)
  local a = next_attempt(msgid, crid, known)
  leases[#leases + 1] = lease; leases[#leases + 1] = cid
  budget[crid] = budget[crid] - 1
  pushed = pushed + 1
  emit(cid, 't', content, a, crid)
end
-- What take() reads of each id, in two HMGETs for the lot: the messages, and their
-- traceparent, expiry and attempt fields (three an id).
local function prefetch(ids)
  local msgids, fields = {}, {}
  for i = 1, #ids do
    local msgid, crid = split(ids[i])
    msgids[i] = msgid
    fields[#fields + 1] = field(msgid, 'tp')
    fields[#fields + 1] = field(msgid, 'x')
    fields[#fields + 1] = field(msgid, 'n', crid)
  end
  return call_all('HMGET', msgs, msgids), call_all('HMGET', state, fields)
end
-- `m`: the message as prefetched; `f`, `at`: its fields as prefetched, from index `at`.
local function take(id, m, f, at)
  local msgid, crid = split(id)
  if not m then return end
  local kind, start
  kind, stored, start = read_message(m, now)
  trace = f[at] or ''
  local x = f[at + 1] and tonumber(f[at + 1])
  if x and now >= x then
    write_out()
    local a = tonumber(f[at + 2] or '0')
    if not crid then advance(state, kq, ready, delayed, msgid, now) end
    expire(msgs, state, dead, id, now, drop, 'attempt=' .. a .. ' recipient=' .. (crid or '')
           .. ' expired: its ttl ran out before it was pushed')
    emit(id, 'x', drop and 'drop' or 'dead', a, crid or '')
    return
  end
  local content = string.sub(m, start)
  if crid then
    if lost[crid] then
      redis.call('ZADD', delayed, now + lost_wait, id)
      return true
    elseif budget[crid] and budget[crid] <= 0 then
      redis.call('ZADD', delayed, now + 200, id)
      return true
    elseif budget[crid] and not can_length[crid] and needs_length(content) then
      write_out()
      redis.call('HINCRBY', state, field(msgid, 'o'), -1)
      redis.call('HINCRBY', state, field(msgid, 'dc'), 1)
      bury(id, msgid, crid, crid)
    else
      if not budget[crid] then budget[crid] = 1 end
      lease_copy(id, msgid, crid, content, f[at + 2])
    end
  elseif kind == 'q' then
    local rid = ARGV[qi]
    qi = qi + 1
    if not can_length[rid] and needs_length(content) then
      rid = capable()
      if not rid then
        write_out()
        return bury(id, msgid, nil, '')
      end
    end
    local a = next_attempt(msgid, nil, f[at + 2])
    sets[#sets + 1] = field(msgid, 'r'); sets[#sets + 1] = rid
    leases[#leases + 1] = lease; leases[#leases + 1] = id
    budget[rid] = (budget[rid] or 1) - 1
    pushed = pushed + 1
    emit(id, 'q', content, a, rid)
  else
    -- a topic message fanned out now: its copies have no state yet
    local live, buried = 0, 0
    local long = needs_length(content)
    for j = 1, k do
      local rid = alive[j]
      local cid = msgid .. SEP .. rid
      if long and not can_length[rid] then
        write_out()
        buried = buried + 1
        bury(cid, msgid, rid, rid)
      elseif budget[rid] > 0 then
        live = live + 1
        lease_copy(cid, msgid, rid, content, false)
      else
        live = live + 1
        sets[#sets + 1] = field(msgid, 'n', rid); sets[#sets + 1] = 0
        redis.call('ZADD', delayed, now, cid)
      end
    end
    sets[#sets + 1] = field(msgid, 'o'); sets[#sets + 1] = live
    sets[#sets + 1] = field(msgid, 'dc'); sets[#sets + 1] = buried
    sets[#sets + 1] = field(msgid, 'c'); sets[#sets + 1] = table.concat(alive, SEP)
  end
end
local taken = 0
if k > 0 and n > 0 then
  local due = redis.call('ZRANGEBYSCORE', delayed, '-inf', now, 'LIMIT', 0, n + 64)
  if #due > 0 then
    local m, f = prefetch(due)
    for i, id in ipairs(due) do
      if taken >= n then break end
      redis.call('ZREM', delayed, id)
      -- a copy waiting for its recipient's window does not count
      if not take(id, m[i], f, 3 * i - 2) then taken = taken + 1 end
    end
  end
  if taken < n then
    local ids = redis.call('LPOP', ready, n - taken)
    if ids then
      local m, f = prefetch(ids)
      for i, id in ipairs(ids) do take(id, m[i], f, 3 * i - 2) end
    end
  end
end
write_out()
local nxt = redis.call('ZRANGE', delayed, 0, 0, 'WITHSCORES')
if nxt[2] then out[#out + 1] = nxt[2] else out[#out + 1] = -1 end
local wait = 0
if rate > 0 then
  tokens = tokens - pushed
  redis.call('HSET', ratek, 't', tokens, 'ts', now)
  if tokens < 1 then wait = math.ceil((1 - tokens) * 1000 / rate) end
end
out[#out + 1] = wait
return out
