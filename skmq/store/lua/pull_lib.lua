-- Shared by the pull scripts (skmq/pull/): one consumer group's view of an app's group
-- log. Prepended after lib.lua.
--   groups    HASH    group -> cursor: the last log entry id the group has read
--   glog      STREAM  the group log: m msgid, k kind q|t, c content, d deliver_at ms,
--                     x expires_at ms (only with a TTL), o ordering key (only with one),
--                     n how many entries were ever added to the log with it (feed.lua)
-- and the group's own keys (g:<group>:<name>):
--   inflight  ZSET    entry id -> lease deadline ms (received, not settled)
--   delayed   ZSET    entry id -> due ms (a delay, or a retry wait)
--   held      ZSET    entry id -> its ms: every entry the group still needs (log trimming)
--   gstate    HASH    <entry id>\31n attempts, <entry id>\31e last error, <entry id>\31t
--                     1 when a replay lifted its TTL, <entry id>\31b the attempts made
--                     before its last replay (a replay renews the attempts a message
--                     has, while `n` goes on counting: a receipt of attempt 1 before
--                     the replay must not settle attempt 1 after it), and \31g the
--                     group's generation: Redis's clock_us() when it was made or reset
--                     (none: '0', a group made before generations), and \31r how
--                     many entries were ever added to the log up to the group's cursor
--                     (group_position.lua; none: not known, a group made before it),
--                     and \31p while no entry has an e, t or b field (set as the group
--                     is made or reset, gone with the first: an ack then reads and
--                     deletes an entry's n alone; none: not known, a group made before)
--   dead      ZSET    entry id -> ms it died (the group's dead letters)
--   kq        ZSET    entries with an ordering key not over yet, all scored 0, member
--                     <key>\31<entry id, sortable>\31<entry id>: the first of a key is
--                     the one the group may hand out, the others wait (not delayed, not
--                     in flight) until it is over (acked, or dead); gstate's
--                     <entry id>\31o holds an entry's member
-- A receipt names (entry id, n, generation), n counting every attempt of the entry in
-- the group, replays or not: it settles only that attempt of this generation, while its
-- lease runs; so after a reset, or a delete and create, a receipt
-- of the group before never settles a delivery of the group now.
-- KEYS: groups, glog, inflight, delayed, held, gstate, dead, kq
-- ARGV: now, retry_times, nb, backoff ms * nb, then the script's own arguments
local groups, glog, inflight, delayed = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local held, gstate, dead, gkq = KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local now = tonumber(ARGV[1])
local retry_times = tonumber(ARGV[2])
local backoff, rest = backoff_args(3)

local function nfield(id) return id .. '\31n' end
local function efield(id) return id .. '\31e' end
local function ofield(id) return id .. '\31o' end
local function tfield(id) return id .. '\31t' end
local function bfield(id) return id .. '\31b' end
-- An entry the group is done with (acked, purged, dropped): its own fields go.
local function forget_entry(id)
  redis.call('HDEL', gstate, nfield(id), efield(id), tfield(id), bfield(id))
end
-- Attempt n of an entry as its consumers count it: since its last replay.
local function since_replay(id, n)
  return n - tonumber(redis.call('HGET', gstate, bfield(id)) or '0')
end
local GEN = '\31g'
local PLAIN = '\31p'
-- An entry of the group gets an e, t or b field: acks look for them from now on.
local function not_plain() redis.call('HDEL', gstate, PLAIN) end
local gen  -- read once a call: no script of this group changes it
local function generation()
  if gen == nil then gen = redis.call('HGET', gstate, GEN) or '0' end
  return gen
end

-- True while attempt n of entry id in generation g (a string) is in flight and its lease
-- has not run out.
local function live(id, n, g)
  local deadline = redis.call('ZSCORE', inflight, id)
  if not deadline or tonumber(deadline) < now then return false end
  if tonumber(redis.call('HGET', gstate, nfield(id)) or '0') ~= n then return false end
  return generation() == g
end

-- A log entry's fields by name (from XRANGE's flat list; false: none). The table is
-- made with room for every field the log has: filled, it is not grown field by field.
local function fields(flat)
  local f = {m = false, k = false, c = false, d = false, n = false, x = false, o = false,
             t = false}
  for j = 1, #flat, 2 do f[flat[j]] = flat[j + 1] end
  return f
end
-- When entry id expires (0: never): its TTL's end, unless a replay lifted it.
local function expires(id, f)
  local x = tonumber(f.x or '0')
  if x > 0 and x <= now and redis.call('HEXISTS', gstate, tfield(id)) == 1 then return 0 end
  return x
end

-- Entry id is over for the group (acked, dead, expired): the next entry of its ordering
-- key, if any, falls due now (a receive's wake-up is published).
local function release(id)
  local member = redis.call('HGET', gstate, ofield(id))
  if not member then return end
  redis.call('HDEL', gstate, ofield(id))
  redis.call('ZREM', gkq, member)
  local nxt = key_head(gkq, string.sub(member, 1, string.find(member, SEP, 1, true) - 1))
  if nxt then
    redis.call('ZADD', delayed, now, string.match(nxt, '([^\31]+)$'))
    redis.call('PUBLISH', glog, now)
  end
end

-- A failed attempt (nack, or a lease run out): retried `wait` ms after `since` (negative:
-- the backoff of its attempt; at its expiry at the latest), or dead after retry_times.
-- `since` is when it failed: now for a nack, the lease's end for a lease that ran out
-- (noticed only at the next receive, which must not lengthen the wait).
-- Returns {code 1 retry | 2 dead, due}.
-- A retry keeps its ordering key held.
local function fail_attempt(id, why, wait, since)
  redis.call('ZREM', inflight, id)
  local n = since_replay(id, tonumber(redis.call('HGET', gstate, nfield(id)) or '0'))
  redis.call('HSET', gstate, efield(id), why)
  not_plain()
  if n >= retry_times then
    redis.call('ZADD', dead, now, id)
    release(id)
    return {2, now}
  end
  if wait < 0 then wait = backoff[math.max(1, math.min(n, #backoff))] end
  local due = since + wait
  local e = redis.call('XRANGE', glog, id, id)[1]
  local x = e and expires(id, fields(e[2])) or 0
  if x > 0 and due > x then due = x end  -- at its expiry at the latest
  redis.call('ZADD', delayed, due, id)
  return {1, due}
end

-- Receipts (entry id, n, generation, then the script's own arguments): fn where attempt
-- n is live. Returns, for each, its attempt since the entry's last replay (0: not live).
local function each_live(width, fn)
  local out = {}
  for i = rest, #ARGV, width do
    local id, n = ARGV[i], tonumber(ARGV[i + 1])
    if live(id, n, ARGV[i + 2]) then
      out[#out + 1] = since_replay(id, n)
      fn(id, unpack(ARGV, i + 3, i + width - 1))
    else
      out[#out + 1] = 0
    end
  end
  return out
end

-- Entry ids (ARGV from `rest` on): out of `dead`, then fn, where it is a dead letter of
-- the group. Returns 1 for each it ran for, 0 for the others.
local function each_dead(fn)
  local out = {}
  for i = rest, #ARGV do
    if redis.call('ZREM', dead, ARGV[i]) == 1 then
      fn(ARGV[i])
      out[#out + 1] = 1
    else
      out[#out + 1] = 0
    end
  end
  return out
end
