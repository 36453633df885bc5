-- received -> pending | delayed | waiting for its key (a msgid stored or completed
-- within the dedupe window: refused as a duplicate).
-- The app's `listed` mark is set in the same step: the store (skmq/store/directory.py)
-- then lists the app in the apps directory when the mark is new, and a forget that raced
-- with this store finds the mark and lists it again.
-- A message with a TTL keeps its expiry in `state`; a delayed one falls due at its
-- expiry at the latest (then a claim dead-letters it). A message with an ordering key
-- joins `kq`; it waits there while an earlier message of its key is not over.
-- Once the app has a consumer group (skmq/pull/), a stored message is also appended to
-- the group log `glog` (groups read it from their cursors) and the log's channel is told;
-- while no push recipient is registered, it then skips the push queue (docs/HTTP.md).
-- KEYS: msgs, ready, delayed, listed, groups, glog, gseen, recipients, state, kq,
--       done:<current bucket>, done:<previous bucket>
-- ARGV: now (13 digits), then (msgid, kind q|t, content, deliver_at ms,
--       expires_at ms (0: never), ordering key ('' : none), traceparent ('' : none))*
-- Returns 1 if the mark is new (else 0), then 1 (stored) or 0 (duplicate) a message.
local msgs, ready, delayed, listed = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local groups, glog, gseen, recipients = KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local state, kq, cur, prev = KEYS[9], KEYS[10], KEYS[11], KEYS[12]
local now = ARGV[1]
local pulled = redis.call('HLEN', groups) > 0
local pull_only = pulled and redis.call('HLEN', recipients) == 0
local out = {redis.call('SET', listed, 1, 'NX') and 1 or 0}
local logged = false

-- The push side: the message waits in `ready`, `delayed` or behind its key.
local function queue(id, at, x, key)
  if x > 0 then
    redis.call('HSET', state, field(id, 'x'), x)
    if at > x then at = x end
  end
  local waits = false
  if key ~= '' then
    waits = key_head(kq, key)
    local seq = redis.call('HINCRBY', state, SEP .. 'kseq', 1)
    local member = key .. SEP .. string.format('%016d', seq) .. SEP .. id
    redis.call('ZADD', kq, 0, member)
    redis.call('HSET', state, field(id, 'k'), member)
  end
  if waits then
    if at > tonumber(now) then redis.call('HSET', state, field(id, 'd'), at) end
  elseif at > tonumber(now) then
    redis.call('ZADD', delayed, at, id)
  else
    redis.call('RPUSH', ready, id)
  end
end

for i = 2, #ARGV, 7 do
  local id = ARGV[i]
  if redis.call('SISMEMBER', cur, id) == 1 or redis.call('SISMEMBER', prev, id) == 1
      or redis.call('HEXISTS', msgs, id) == 1
      or (pulled and redis.call('HEXISTS', gseen, id) == 1) then
    out[#out + 1] = 0
  else
    local at = tonumber(ARGV[i + 3])
    if not pull_only then
      redis.call('HSET', msgs, id, ARGV[i + 1] .. now .. ARGV[i + 2])
      queue(id, at, tonumber(ARGV[i + 4]), ARGV[i + 5])
      if ARGV[i + 6] ~= '' then redis.call('HSET', state, field(id, 'tp'), ARGV[i + 6]) end
    end
    if pulled then
      local eid = redis.call('XADD', glog, '*', 'm', id, 'k', ARGV[i + 1], 'c', ARGV[i + 2],
                            'd', at)
      redis.call('HSET', gseen, id, eid)
      logged = true
    end
    out[#out + 1] = 1
  end
end
if logged then redis.call('PUBLISH', glog, now) end
return out
