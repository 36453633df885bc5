"""The Lua scripts behind every Redis state change that touches more than one key.

Every script works on the keys of ONE app, all sharing the hash tag `{app}`, and gets
that app's key base (`<prefix>:{<app>}:`) as KEYS[1]; STORE and FORGET also touch the
apps set (`<prefix>:apps`), passed in KEYS, and FORGET gets each of its keys in KEYS.
Key layout under the base:

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

# KEYS[2]: the apps set. ARGV: now (13 digits), done bucket (current), done bucket
# (previous), app, then (msgid, kind q|t, content, deliver_at)*. Returns 1 (stored) or
# 0 (duplicate) each. The app joins the apps set in the same step, so that FORGET can
# never drop an app between a store and its discovery.
STORE = (
    COMMON
    + r"""
local now = ARGV[1]
local cur = base .. 'done:' .. ARGV[2]
local prev = base .. 'done:' .. ARGV[3]
redis.call('SADD', KEYS[2], ARGV[4])
local out = {}
for i = 5, #ARGV, 4 do
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

# ARGV: now, lease ms, n, k, rate, alive rid * k, queue assignment rid * n
# Takes up to n messages, due retries and delays first, then the ready list; with a
# rate (DELIVERY_RATE, pushes/s for the app, whichever brokers push) a token bucket
# under `rate` holding a tenth of a second's burst caps the pushes. Returns
# (delivery id, kind, content, attempt, rid)*, then the next due ms (-1: none), then the
# ms until the bucket has a token again (0: not limited).
CLAIM = (
    COMMON
    + r"""
local now = tonumber(ARGV[1])
local lease = now + tonumber(ARGV[2])
local n = tonumber(ARGV[3])
local k = tonumber(ARGV[4])
local rate = tonumber(ARGV[5])
local qi = 6 + k
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
local function take(id)
  local msgid, crid = split(id)
  local m = redis.call('GET', base .. 'm:' .. msgid)
  if not m then return end
  local sk = base .. 's:' .. msgid
  local content = string.sub(m, 15)
  if crid then
    local a = redis.call('HINCRBY', sk, 'n:' .. crid, 1)
    redis.call('ZADD', inflight, lease, id)
    out[#out + 1] = id; out[#out + 1] = 't'; out[#out + 1] = content
    out[#out + 1] = a; out[#out + 1] = crid
  elseif string.sub(m, 1, 1) == 'q' then
    local rid = ARGV[qi]
    qi = qi + 1
    local a = redis.call('HINCRBY', sk, 'n', 1)
    redis.call('HSET', sk, 'r', rid)
    redis.call('ZADD', inflight, lease, id)
    out[#out + 1] = id; out[#out + 1] = 'q'; out[#out + 1] = content
    out[#out + 1] = a; out[#out + 1] = rid
  else
    for j = 1, k do
      local rid = ARGV[5 + j]
      local cid = msgid .. '\31' .. rid
      redis.call('HSET', sk, 'n:' .. rid, 1)
      redis.call('ZADD', inflight, lease, cid)
      out[#out + 1] = cid; out[#out + 1] = 't'; out[#out + 1] = content
      out[#out + 1] = 1; out[#out + 1] = rid
    end
    redis.call('HSET', sk, 'o', k, 'dc', 0)
  end
end
local taken = 0
if k > 0 and n > 0 then
  local due = redis.call('ZRANGEBYSCORE', base .. 'delayed', '-inf', now, 'LIMIT', 0, n)
  for _, id in ipairs(due) do
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
  tokens = tokens - (#out - 1) / 5  -- 5 values a delivery claimed; not the nxt entry
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

# ARGV: now, done bucket, done ttl ms, then delivery ids.
# An ack completes the delivery wherever it stands (in flight, waiting for a retry,
# or dead: the recipient did process it). Returns (ok, attempt, stored ts, recipient)*.
FINISH = (
    COMMON
    + r"""
local done = base .. 'done:' .. ARGV[2]
local added = false
local out = {}
for i = 4, #ARGV do
  local id = ARGV[i]
  local msgid, crid = split(id)
  local mk = base .. 'm:' .. msgid
  local sk = base .. 's:' .. msgid
  local found = redis.call('ZREM', base .. 'inflight', id)
  local was_dead = 0
  if found == 0 then
    found = redis.call('ZREM', base .. 'delayed', id)
    if found == 0 then
      was_dead = redis.call('ZREM', base .. 'dead', id)
      found = was_dead
    end
  end
  local ts = false
  if found == 1 then ts = redis.call('GETRANGE', mk, 1, 13) end
  if not ts or ts == '' then
    out[#out + 1] = 0; out[#out + 1] = 0; out[#out + 1] = 0; out[#out + 1] = ''
  else
    local s = sfx(crid)
    local f = redis.call('HMGET', sk, 'n' .. s, 'r')
    local complete = true
    if crid then
      if was_dead == 1 then
        redis.call('HINCRBY', sk, 'dc', -1)
        redis.call('HINCRBY', sk, 'o', 1)
      end
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
    out[#out + 1] = 1; out[#out + 1] = tonumber(f[1] or '0'); out[#out + 1] = tonumber(ts)
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

# ARGV: msgid, recipient hint. Finds the delivery an answer without push-connection
# context is for: the msgid itself for a queue message; for a topic message the copy
# of the hinted recipient, else the first copy still waiting for an answer.
RESOLVE = (
    COMMON
    + r"""
local msgid = ARGV[1]
local kind = redis.call('GETRANGE', base .. 'm:' .. msgid, 0, 0)
if kind == '' then return false end
if kind == 'q' then return msgid end
if ARGV[2] ~= '' then return msgid .. '\31' .. ARGV[2] end
local fields = redis.call('HKEYS', base .. 's:' .. msgid)
local fallback = false
for _, f in ipairs(fields) do
  if string.sub(f, 1, 2) == 'n:' then
    local cid = msgid .. '\31' .. string.sub(f, 3)
    if redis.call('ZSCORE', base .. 'inflight', cid) then return cid end
    if not fallback and redis.call('ZSCORE', base .. 'delayed', cid) then fallback = cid end
  end
end
return fallback
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

# Forget an app that holds nothing: no recipients and no message ready, delayed, in
# flight or dead. KEYS: ready, delayed, inflight, dead, recipients, rstate, rbeat, rate
# (under the app's base), then the apps set. ARGV: app. Returns 1 if forgotten.
FORGET_KEYS = ("ready", "delayed", "inflight", "dead", "recipients", "rstate", "rbeat", "rate")
FORGET = r"""
if redis.call('LLEN', KEYS[1]) > 0 or redis.call('ZCARD', KEYS[2]) > 0
    or redis.call('ZCARD', KEYS[3]) > 0 or redis.call('ZCARD', KEYS[4]) > 0
    or redis.call('HLEN', KEYS[5]) > 0 then
  return 0
end
redis.call('DEL', KEYS[6], KEYS[7], KEYS[8])
return redis.call('SREM', KEYS[9], ARGV[1])
"""

ALL = {
    "forget": FORGET,
    "store": STORE,
    "claim": CLAIM,
    "fail": FAIL,
    "reap": REAP,
    "finish": FINISH,
    "release": RELEASE,
    "resolve": RESOLVE,
    "replay": REPLAY,
    "purge": PURGE,
    "set_state": SET_STATE,
    "register": REGISTER,
    "unregister": UNREGISTER,
}
