-- Shared by fail.lua and reap.lua: a failed attempt (reject, error, timeout, broken
-- connection) is retried after the backoff of its attempt, or dead after retry_times;
-- a message whose TTL ran out by then is expired instead (dead-lettered with the reason
-- `expired`, or dropped when drop is 1), and no retry waits past its expiry.
-- Each wait is spread by +-jitter (a fraction) from `random` (0..1, drawn by the caller:
-- math.random is deterministic in Redis scripts); the failures of one call get values
-- spread from it by the golden ratio, so that a burst does not come back in lockstep.
-- A message over (dead or expired) lets the next message of its ordering key go.
-- KEYS: msgs, state, delayed, inflight, dead, ready, kq
-- ARGV: now, limit, retry_times, drop 0|1, jitter, random, nb, backoff ms * nb, then the
--       script's own arguments
local msgs, state, delayed, inflight, dead = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local ready, kq = KEYS[6], KEYS[7]
local now = tonumber(ARGV[1])
local retry_times = tonumber(ARGV[3])
local drop = ARGV[4] == '1'
local jitter = tonumber(ARGV[5])
local spread = tonumber(ARGV[6])
local backoff, rest = backoff_args(7)
-- `attempt` fences the answer: a failure reported for attempt 1 must not end attempt 2,
-- which another broker may hold by now (0: whichever attempt is current).
-- Returns {code, attempt, due, rid}: code 0 not in flight (stale), 1 retry, 2 dead,
-- 3 expired (dead-lettered), 4 expired (dropped).
local function fail_one(id, outcome, detail, rid_hint, attempt)
  if not redis.call('ZSCORE', inflight, id) then return {0, 0, 0, rid_hint} end
  local msgid, crid = split(id)
  local f = redis.call('HMGET', state, field(msgid, 'n', crid), field(msgid, 'r'))
  local n = tonumber(f[1] or '0')
  if attempt > 0 and n ~= attempt then return {0, n, 0, rid_hint} end
  -- A recipient's failure ends only an attempt pushed to it: a late answer reaching a
  -- broker that knows nothing of its push names no attempt, but it may name its sender.
  if not crid and rid_hint ~= '' and f[2] and f[2] ~= rid_hint then
    return {0, n, 0, rid_hint}
  end
  redis.call('ZREM', inflight, id)
  if redis.call('HEXISTS', msgs, msgid) == 0 then return {0, 0, 0, rid_hint} end
  local rid = crid or rid_hint
  if rid == '' then rid = f[2] or '' end
  local x = expiry(state, msgid)
  if x and now >= x then
    if not crid then advance(state, kq, ready, delayed, msgid, now) end
    expire(msgs, state, dead, id, now, drop, 'attempt=' .. n .. ' recipient=' .. rid .. ' '
           .. outcome .. ': ' .. detail .. '; expired: its ttl ran out')
    if drop then return {4, n, now, rid} end
    return {3, n, now, rid}
  end
  note(state, msgid, crid,
       now .. ' attempt=' .. n .. ' recipient=' .. rid .. ' ' .. outcome .. ': ' .. detail,
       outcome .. ': ' .. detail)
  if n >= retry_times then
    redis.call('ZADD', dead, now, id)
    if not crid then advance(state, kq, ready, delayed, msgid, now) end
    if crid then
      redis.call('HINCRBY', state, field(msgid, 'o'), -1)
      redis.call('HINCRBY', state, field(msgid, 'dc'), 1)
    end
    return {2, n, now, rid}
  end
  local i = n
  if i > #backoff then i = #backoff end
  if i < 1 then i = 1 end
  spread = (spread + 0.6180339887) % 1
  local due = now + math.floor(backoff[i] * (1 + jitter * (2 * spread - 1)))
  if x and due > x then due = x end
  redis.call('ZADD', delayed, due, id)
  return {1, n, due, rid}
end
