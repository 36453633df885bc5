-- Shared by the pull scripts (skmq/pull/): one consumer group's view of an app's group
-- log. Prepended after lib.lua.
--   groups    HASH    group -> cursor: the last log entry id the group has read
--   glog      STREAM  the group log: m msgid, k kind q|t, c content, d deliver_at ms,
--                     x expires_at ms (only with a TTL)
-- and the group's own keys (g:<group>:<name>):
--   inflight  ZSET    entry id -> lease deadline ms (received, not settled)
--   delayed   ZSET    entry id -> due ms (a delay, or a retry wait)
--   held      ZSET    entry id -> its ms: every entry the group still needs (log trimming)
--   gstate    HASH    <entry id>\31n attempts, <entry id>\31e last error, and \31g the
--                     group's generation: Redis's clock_us() when it was made or reset
--                     (none: '0', a group made before generations)
--   dead      ZSET    entry id -> ms it died (the group's dead letters)
-- A receipt names (entry id, attempt n, generation): it settles only attempt n of this
-- generation, while its lease runs; so after a reset, or a delete and create, a receipt
-- of the group before never settles a delivery of the group now.
-- KEYS: groups, glog, inflight, delayed, held, gstate, dead
-- ARGV: now, retry_times, nb, backoff ms * nb, then the script's own arguments
local groups, glog, inflight, delayed = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local held, gstate, dead = KEYS[5], KEYS[6], KEYS[7]
local now = tonumber(ARGV[1])
local retry_times = tonumber(ARGV[2])
local backoff, rest = backoff_args(3)

local function nfield(id) return id .. '\31n' end
local function efield(id) return id .. '\31e' end
local GEN = '\31g'
local function generation() return redis.call('HGET', gstate, GEN) or '0' end

-- True while attempt n of entry id in generation g (a string) is in flight and its lease
-- has not run out.
local function live(id, n, g)
  local deadline = redis.call('ZSCORE', inflight, id)
  if not deadline or tonumber(deadline) < now then return false end
  if tonumber(redis.call('HGET', gstate, nfield(id)) or '0') ~= n then return false end
  return generation() == g
end

-- A failed attempt (nack, or a lease run out): retried after `wait` ms (negative: the
-- backoff of its attempt), or dead after retry_times. Returns {code 1 retry | 2 dead, due}.
local function fail_attempt(id, why, wait)
  redis.call('ZREM', inflight, id)
  local n = tonumber(redis.call('HGET', gstate, nfield(id)) or '0')
  redis.call('HSET', gstate, efield(id), why)
  if n >= retry_times then
    redis.call('ZADD', dead, now, id)
    return {2, now}
  end
  if wait < 0 then wait = backoff[math.max(1, math.min(n, #backoff))] end
  redis.call('ZADD', delayed, now + wait, id)
  return {1, now + wait}
end

-- For each receipt in ARGV from `rest` on, `width` arguments a receipt (entry id,
-- attempt n, generation, then the script's own): fn(entry id, the script's own
-- arguments) where attempt n is live. Returns 1 for each receipt it ran for, 0 for the
-- others.
local function each_live(width, fn)
  local out = {}
  for i = rest, #ARGV, width do
    local id = ARGV[i]
    if live(id, tonumber(ARGV[i + 1]), ARGV[i + 2]) then
      fn(id, unpack(ARGV, i + 3, i + width - 1))
      out[#out + 1] = 1
    else
      out[#out + 1] = 0
    end
  end
  return out
end
