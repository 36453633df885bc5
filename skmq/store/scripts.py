"""The Lua scripts behind every Redis state change that touches more than one key.

Every script works on the keys of ONE app, all sharing the hash tag `{app}`, and gets
that app's key base (`<prefix>:{<app>}:`) as KEYS[1]. Key layout under the base:

    m:<msgid>   STRING  kind (q|t), stored ms (13 digits), then the content: a plain
                        string, because a waiting message should cost as little as
                        possible (a small hash costs ~190 bytes more here)
    s:<msgid>   HASH    delivery state, created at the first claim: n attempts,
                        r last recipient, e last error, h history; a topic message
                        keeps n:<rid> / e:<rid> / h:<rid> a copy, o copies
                        outstanding, dc copies dead
    ready       LIST    delivery ids ready to push, FIFO
    delayed     ZSET    delivery id -> due ms (delayed messages, retry waits, replays)
    inflight    ZSET    delivery id -> lease deadline ms (pushed, waiting for an answer)
    dead        ZSET    delivery id -> ms it died (the dead-letter queue)
    done:<b>    SET     msgids completed in time bucket b (dedupe after completion)
    recipients  HASH    rid -> JSON registration
    rstate      HASH    rid -> 1 alive | 0 lost
    rbeat       HASH    rid -> ms of the last answered heartbeat

A delivery id is the msgid for a queue message (and for a topic message not yet
fanned out), and `msgid \\x1f rid` for one recipient's copy of a topic message.
The msgid only ever follows `m:`/`s:` or sits inside a collection, so no msgid can
collide with a key of the broker.
"""

from __future__ import annotations

COMMON = r"""
local base = KEYS[1]
local function split(id)
  local p = string.find(id, '\31', 1, true)
  if p then return string.sub(id, 1, p - 1), string.sub(id, p + 1) end
  return id, nil
end
local function sfx(crid) if crid then return ':' .. crid end return '' end
"""

# ARGV: now (13 digits), done bucket (current), done bucket (previous),
# then (msgid, kind q|t, content, deliver_at)*. Returns 1 (stored) or 0 (duplicate) each.
STORE = (
    COMMON
    + r"""
local now = ARGV[1]
local cur = base .. 'done:' .. ARGV[2]
local prev = base .. 'done:' .. ARGV[3]
local out = {}
for i = 4, #ARGV, 4 do
  local id = ARGV[i]
  if redis.call('SISMEMBER', cur, id) == 1 or redis.call('SISMEMBER', prev, id) == 1
      or not redis.call('SET', base .. 'm:' .. id, ARGV[i + 1] .. now .. ARGV[i + 2], 'NX') then
    out[#out + 1] = 0
  else
    local at = tonumber(ARGV[i + 3])
    if at > tonumber(now) then
      redis.call('ZADD', base .. 'delayed', at, id)
    else
      redis.call('RPUSH', base .. 'ready', id)
    end
    out[#out + 1] = 1
  end
end
return out
"""
)

# ARGV: now, lease ms, n, k, rate, (alive rid, free slots, length capable 0|1) * k,
# queue assignment rid * n.
# Takes up to n messages, due retries and delays first, then the ready list; with a
# rate (DELIVERY_RATE, pushes/s for the app, whichever brokers push) a token bucket
# under `rate` holding a tenth of a second's burst caps the pushes. A topic copy goes in
# flight only while its recipient has a free window slot (PUSH_WINDOW holds for topics
# too); the others wait in `delayed`. Content holding CR or LF needs `length=`: it goes
# only to a recipient that declared the `length` capability, else it is dead-lettered.
# Returns (delivery id, kind, content, attempt, rid)* (kind `d`: dead-lettered here, the
# content then being the reason), then the next due ms (-1: none), then the ms until the
# bucket has a token again (0: not limited).
CLAIM = (
    COMMON
    + r"""
local now = tonumber(ARGV[1])
local lease = now + tonumber(ARGV[2])
local n = tonumber(ARGV[3])
local k = tonumber(ARGV[4])
local rate = tonumber(ARGV[5])
local alive, budget, can_length = {}, {}, {}
for j = 1, k do
  local rid = ARGV[3 + 3 * j]
  alive[j] = rid
  budget[rid] = tonumber(ARGV[4 + 3 * j])
  can_length[rid] = ARGV[5 + 3 * j] == '1'
end
local qi = 6 + 3 * k
local tokens = 0
if rate > 0 then
  local burst = math.max(1, rate / 10)
  local st = redis.call('HMGET', base .. 'rate', 't', 'ts')
  tokens = tonumber(st[1] or burst)
  tokens = math.min(burst, tokens + (now - tonumber(st[2] or now)) * rate / 1000)
  if n > math.floor(tokens) then n = math.floor(tokens) end
end
local inflight = base .. 'inflight'
local out = {}
local pushed = 0
local function emit(id, kind, content, a, rid)
  out[#out + 1] = id; out[#out + 1] = kind; out[#out + 1] = content
  out[#out + 1] = a; out[#out + 1] = rid
end
local function needs_length(content) return string.find(content, '[\r\n]') ~= nil end
local function capable()
  for j = 1, k do if can_length[alive[j]] then return alive[j] end end
  return nil
end
local UNDELIVERABLE = 'undeliverable: content holds CR or LF and no recipient declared '
  .. 'the length capability'
local function bury(id, sk, crid, rid)
  local s = sfx(crid)
  redis.call('HSET', sk, 'e' .. s, UNDELIVERABLE, 'h' .. s,
             now .. ' attempt=0 recipient=' .. rid .. ' ' .. UNDELIVERABLE)
  redis.call('ZADD', base .. 'dead', now, id)
  emit(id, 'd', UNDELIVERABLE, 0, rid)
end
local function lease_copy(sk, cid, crid, content)
  local a = redis.call('HINCRBY', sk, 'n:' .. crid, 1)
  redis.call('ZADD', inflight, lease, cid)
  budget[crid] = budget[crid] - 1
  pushed = pushed + 1
  emit(cid, 't', content, a, crid)
end
local function take(id)
  local msgid, crid = split(id)
  local m = redis.call('GET', base .. 'm:' .. msgid)
  if not m then return end
  local sk = base .. 's:' .. msgid
  local content = string.sub(m, 15)
  if crid then
    if budget[crid] and budget[crid] <= 0 then
      redis.call('ZADD', base .. 'delayed', now + 200, id)
    elseif budget[crid] and not can_length[crid] and needs_length(content) then
      redis.call('HINCRBY', sk, 'o', -1)
      redis.call('HINCRBY', sk, 'dc', 1)
      bury(id, sk, crid, crid)
    else
      if not budget[crid] then budget[crid] = 1 end
      lease_copy(sk, id, crid, content)
    end
  elseif string.sub(m, 1, 1) == 'q' then
    local rid = ARGV[qi]
    qi = qi + 1
    if not can_length[rid] and needs_length(content) then
      rid = capable()
      if not rid then return bury(id, sk, nil, '') end
    end
    local a = redis.call('HINCRBY', sk, 'n', 1)
    redis.call('HSET', sk, 'r', rid)
    redis.call('ZADD', inflight, lease, id)
    budget[rid] = (budget[rid] or 1) - 1
    pushed = pushed + 1
    emit(id, 'q', content, a, rid)
  else
    local live, dead = 0, 0
    local long = needs_length(content)
    for j = 1, k do
      local rid = alive[j]
      local cid = msgid .. '\31' .. rid
      if long and not can_length[rid] then
        dead = dead + 1
        bury(cid, sk, rid, rid)
      elseif budget[rid] > 0 then
        live = live + 1
        lease_copy(sk, cid, rid, content)
      else
        live = live + 1
        redis.call('HSET', sk, 'n:' .. rid, 0)
        redis.call('ZADD', base .. 'delayed', now, cid)
      end
    end
    redis.call('HSET', sk, 'o', live, 'dc', dead)
  end
end
local taken = 0
if k > 0 and n > 0 then
  local due = redis.call('ZRANGEBYSCORE', base .. 'delayed', '-inf', now, 'LIMIT', 0, n + 64)
  for _, id in ipairs(due) do
    if taken >= n then break end
    redis.call('ZREM', base .. 'delayed', id)
    take(id)
    taken = taken + 1
  end
  if taken < n then
    local ids = redis.call('LPOP', base .. 'ready', n - taken)
    if ids then for _, id in ipairs(ids) do take(id) end end
  end
end
local nxt = redis.call('ZRANGE', base .. 'delayed', 0, 0, 'WITHSCORES')
if nxt[2] then out[#out + 1] = nxt[2] else out[#out + 1] = -1 end
local wait = 0
if rate > 0 then
  tokens = tokens - pushed
  redis.call('HSET', base .. 'rate', 't', tokens, 'ts', now)
  if tokens < 1 then wait = math.ceil((1 - tokens) * 1000 / rate) end
end
out[#out + 1] = wait
return out
"""
)

# A failed attempt (reject, error, timeout, broken connection): retry after the
# backoff of its attempt, or dead after retry_times attempts. The scripts using it take
# ARGV: now, limit, retry_times, nb, backoff ms * nb, then their own arguments.
FAIL_ONE = r"""
local now = tonumber(ARGV[1])
local retry_times = tonumber(ARGV[3])
local nb = tonumber(ARGV[4])
local backoff = {}
for j = 1, nb do backoff[j] = tonumber(ARGV[4 + j]) end
local rest = 5 + nb
-- `attempt` fences the answer: a failure reported for attempt 1 must not end attempt 2,
-- which another broker may hold by now (0: whichever attempt is current).
local function fail_one(id, outcome, detail, rid_hint, attempt)
  if not redis.call('ZSCORE', base .. 'inflight', id) then return {0, 0, 0, rid_hint} end
  local msgid, crid = split(id)
  local sk = base .. 's:' .. msgid
  local s = sfx(crid)
  local f = redis.call('HMGET', sk, 'n' .. s, 'h' .. s, 'r')
  local n = tonumber(f[1] or '0')
  if attempt > 0 and n ~= attempt then return {0, n, 0, rid_hint} end
  -- A recipient's failure ends only an attempt pushed to it: a late answer reaching a
  -- broker that knows nothing of its push names no attempt, but it may name its sender.
  if not crid and rid_hint ~= '' and f[3] and f[3] ~= rid_hint then
    return {0, n, 0, rid_hint}
  end
  redis.call('ZREM', base .. 'inflight', id)
  if redis.call('EXISTS', base .. 'm:' .. msgid) == 0 then return {0, 0, 0, rid_hint} end
  local rid = crid or rid_hint
  if rid == '' then rid = f[3] or '' end
  local line = now .. ' attempt=' .. n .. ' recipient=' .. rid .. ' ' .. outcome .. ': ' .. detail
  local h = f[2]
  if h then
    h = h .. '\n' .. line
    if #h > 8192 then h = string.sub(h, #h - 8191) end
  else
    h = line
  end
  redis.call('HSET', sk, 'h' .. s, h, 'e' .. s, outcome .. ': ' .. detail)
  if n >= retry_times then
    redis.call('ZADD', base .. 'dead', now, id)
    if crid then
      redis.call('HINCRBY', sk, 'o', -1)
      redis.call('HINCRBY', sk, 'dc', 1)
    end
    return {2, n, now, rid}
  end
  local i = n
  if i > #backoff then i = #backoff end
  if i < 1 then i = 1 end
  local due = now + backoff[i]
  redis.call('ZADD', base .. 'delayed', due, id)
  return {1, n, due, rid}
end
"""

# ARGV: (see FAIL_ONE), then (id, outcome, detail, rid, attempt)*
# Returns (code, attempt, due, rid)* with code 0 not in flight (stale), 1 retry, 2 dead.
FAIL = (
    COMMON
    + FAIL_ONE
    + r"""
local out = {}
for i = rest, #ARGV, 5 do
  local r = fail_one(ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], tonumber(ARGV[i + 4]))
  for _, v in ipairs(r) do out[#out + 1] = v end
end
return out
"""
)

# ARGV: (see FAIL_ONE). Leases that ran out (the broker that pushed died, or never heard
# back) count as timeouts. Returns (id, code, attempt, due, rid)*.
REAP = (
    COMMON
    + FAIL_ONE
    + r"""
local ids = redis.call('ZRANGEBYSCORE', base .. 'inflight', '-inf', now, 'LIMIT', 0,
                       tonumber(ARGV[2]))
local out = {}
for _, id in ipairs(ids) do
  local r = fail_one(id, 'timeout', 'no final answer within ack_timeout', '', 0)
  out[#out + 1] = id
  for _, v in ipairs(r) do out[#out + 1] = v end
end
return out
"""
)

# ARGV: now, done bucket, done ttl ms, then (delivery id, attempt or 0 for the current)*.
# An ack settles a delivery only while it is in flight, and only the attempt it names
# (a late ack for attempt 1 must not settle attempt 2, perhaps another broker's): a
# delayed, pending, retry-waiting or dead message cannot be acked.
# Returns (ok, attempt, stored ts, recipient)*.
FINISH = (
    COMMON
    + r"""
local done = base .. 'done:' .. ARGV[2]
local added = false
local out = {}
for i = 4, #ARGV, 2 do
  local id = ARGV[i]
  local want = tonumber(ARGV[i + 1])
  local msgid, crid = split(id)
  local mk = base .. 'm:' .. msgid
  local sk = base .. 's:' .. msgid
  local s = sfx(crid)
  local f = redis.call('HMGET', sk, 'n' .. s, 'r')
  local n = tonumber(f[1] or '0')
  local ts = false
  if redis.call('ZSCORE', base .. 'inflight', id) and (want == 0 or want == n) then
    redis.call('ZREM', base .. 'inflight', id)
    ts = redis.call('GETRANGE', mk, 1, 13)
  end
  if not ts or ts == '' then
    out[#out + 1] = 0; out[#out + 1] = n; out[#out + 1] = 0; out[#out + 1] = ''
  else
    local complete = true
    if crid then
      redis.call('HDEL', sk, 'n' .. s, 'h' .. s, 'e' .. s)
      local o = redis.call('HINCRBY', sk, 'o', -1)
      local dc = tonumber(redis.call('HGET', sk, 'dc') or '0')
      complete = o <= 0 and dc <= 0
    end
    if complete then
      redis.call('DEL', mk, sk)
      redis.call('SADD', done, msgid)
      added = true
    end
    out[#out + 1] = 1; out[#out + 1] = n; out[#out + 1] = tonumber(ts)
    out[#out + 1] = crid or f[2] or ''
  end
end
if added then redis.call('PEXPIRE', done, tonumber(ARGV[3])) end
return out
"""
)

# ARGV: delivery ids to hand back without spending an attempt (an unreachable
# recipient's queue messages, or a broker shutting down): queue ones to the head of
# the ready list, topic copies due at once. Returns 1 (released) or 0 (not in flight).
RELEASE = (
    COMMON
    + r"""
local out = {}
for i = 1, #ARGV do
  local id = ARGV[i]
  if redis.call('ZREM', base .. 'inflight', id) == 1 then
    local msgid, crid = split(id)
    if redis.call('EXISTS', base .. 'm:' .. msgid) == 1 then
      redis.call('HINCRBY', base .. 's:' .. msgid, 'n' .. sfx(crid), -1)
      if crid then
        redis.call('ZADD', base .. 'delayed', 0, id)
      else
        redis.call('LPUSH', base .. 'ready', id)
      end
    end
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
"""
)

# ARGV: msgid. The deliveries of msgid now in flight, for an answer that did not come on
# its push connection: (delivery id, recipient, attempt)*.
IN_FLIGHT_OF = (
    COMMON
    + r"""
local msgid = ARGV[1]
local kind = redis.call('GETRANGE', base .. 'm:' .. msgid, 0, 0)
if kind == '' then return {} end
local inflight = base .. 'inflight'
local sk = base .. 's:' .. msgid
local out = {}
if kind == 'q' then
  if redis.call('ZSCORE', inflight, msgid) then
    local f = redis.call('HMGET', sk, 'r', 'n')
    out = {msgid, f[1] or '', tonumber(f[2] or '0')}
  end
  return out
end
local fields = redis.call('HGETALL', sk)
for i = 1, #fields, 2 do
  local f = fields[i]
  if string.sub(f, 1, 2) == 'n:' then
    local cid = msgid .. '\31' .. string.sub(f, 3)
    if redis.call('ZSCORE', inflight, cid) then
      out[#out + 1] = cid; out[#out + 1] = string.sub(f, 3); out[#out + 1] = tonumber(fields[i + 1])
    end
  end
end
return out
"""
)

# ARGV: now, delivery ids. Dead letters back to pending, attempts reset.
REPLAY = (
    COMMON
    + r"""
local now = tonumber(ARGV[1])
local out = {}
for i = 2, #ARGV do
  local id = ARGV[i]
  if redis.call('ZREM', base .. 'dead', id) == 1 then
    local msgid, crid = split(id)
    local sk = base .. 's:' .. msgid
    redis.call('HSET', sk, 'n' .. sfx(crid), 0)
    if crid then
      redis.call('HINCRBY', sk, 'dc', -1)
      redis.call('HINCRBY', sk, 'o', 1)
    end
    redis.call('ZADD', base .. 'delayed', now, id)
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
"""
)

# ARGV: delivery ids. Dead letters removed for good.
PURGE = (
    COMMON
    + r"""
local out = {}
for i = 1, #ARGV do
  local id = ARGV[i]
  if redis.call('ZREM', base .. 'dead', id) == 1 then
    local msgid, crid = split(id)
    local sk = base .. 's:' .. msgid
    local gone = true
    if crid then
      local s = sfx(crid)
      redis.call('HDEL', sk, 'n' .. s, 'h' .. s, 'e' .. s)
      local dc = redis.call('HINCRBY', sk, 'dc', -1)
      local o = tonumber(redis.call('HGET', sk, 'o') or '0')
      gone = o <= 0 and dc <= 0
    end
    if gone then redis.call('DEL', base .. 'm:' .. msgid, sk) end
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
"""
)

# ARGV: rid, state (1 alive | 0 lost), now. Returns the previous state, or -1 when
# the recipient is not registered (then nothing is written).
SET_STATE = (
    COMMON
    + r"""
if redis.call('HEXISTS', base .. 'recipients', ARGV[1]) == 0 then return -1 end
local old = tonumber(redis.call('HGET', base .. 'rstate', ARGV[1]) or '1')
redis.call('HSET', base .. 'rstate', ARGV[1], ARGV[2])
if ARGV[2] == '1' then redis.call('HSET', base .. 'rbeat', ARGV[1], ARGV[3]) end
return old
"""
)

# ARGV: rid, registration JSON, now. Registering (again) makes the recipient alive.
REGISTER = (
    COMMON
    + r"""
redis.call('HSET', base .. 'recipients', ARGV[1], ARGV[2])
redis.call('HSET', base .. 'rstate', ARGV[1], 1)
redis.call('HSET', base .. 'rbeat', ARGV[1], ARGV[3])
return 1
"""
)

# ARGV: rid.
UNREGISTER = (
    COMMON
    + r"""
redis.call('HDEL', base .. 'rstate', ARGV[1])
redis.call('HDEL', base .. 'rbeat', ARGV[1])
return redis.call('HDEL', base .. 'recipients', ARGV[1])
"""
)

ALL = {
    "store": STORE,
    "claim": CLAIM,
    "fail": FAIL,
    "reap": REAP,
    "finish": FINISH,
    "release": RELEASE,
    "in_flight_of": IN_FLIGHT_OF,
    "replay": REPLAY,
    "purge": PURGE,
    "set_state": SET_STATE,
    "register": REGISTER,
    "unregister": UNREGISTER,
}
