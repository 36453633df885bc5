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
-- Each log entry carries `n`, the count of entries ever added to the log with it (kept
-- in `gadded`): a group's backlog is counted from it (skmq/pull/groups.py).
-- KEYS: msgs, ready, delayed, listed, groups, glog, gseen, recipients, state, kq, gadded,
--       done:<current bucket>, done:<previous bucket>
-- ARGV: now (13 digits), then (msgid, header (its kind and now: skmq/store/messages.py),
--       content, deliver_at ms,
--       expires_at ms (0: never), ordering key ('' : none), traceparent ('' : none))*
-- Returns 1 if the mark is new (else 0), then 1 (stored) or 0 (duplicate) a message.
local msgs, ready, delayed, listed = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local groups, glog, gseen, recipients = KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local state, kq, gadded, cur, prev = KEYS[9], KEYS[10], KEYS[11], KEYS[12], KEYS[13]
local now = ARGV[1]
local pulled = redis.call('HLEN', groups) > 0
local pull_only = pulled and redis.call('HLEN', recipients) == 0
local out = {redis.call('SET', listed, 1, 'NX') and 1 or 0}
local logged = false
local added  -- entries ever added to the log: read at the first logged here
-- The batch's writes of `msgs`, `ready` and plain state fields wait here for one call
-- each (ready in stored order); ordered and delayed messages write as they go.
local contents, pushes, sets = {}, {}, {}

-- The push side: the message waits in `ready`, `delayed` or behind its key.
local function queue(id, at, x, key)
  if x > 0 then
    sets[#sets + 1] = field(id, 'x'); sets[#sets + 1] = x
    if at > x then at = x end
  end
  local waits = false
  if key ~= '' then
    waits = key_head(kq, key)
    local seq = redis.call('HINCRBY', state, SEP .. 'kseq', 1)
    local member = key .. SEP .. string.format('%016d', seq) .. SEP .. id
    redis.call('ZADD', kq, 0, member)
    sets[#sets + 1] = field(id, 'k'); sets[#sets + 1] = member
  end
  if waits then
    if at > tonumber(now) then sets[#sets + 1] = field(id, 'd'); sets[#sets + 1] = at end
  elseif at > tonumber(now) then
    redis.call('ZADD', delayed, at, id)
  else
    pushes[#pushes + 1] = id
  end
end

-- Whether each msgid was seen lately: completed (done sets), stored, or in a group log.
local ids = {}
for i = 2, #ARGV, 7 do ids[#ids + 1] = ARGV[i] end
local in_cur = call_all('SMISMEMBER', cur, ids)
local in_prev = call_all('SMISMEMBER', prev, ids)
local in_msgs = call_all('HMGET', msgs, ids)
local in_gseen = pulled and call_all('HMGET', gseen, ids) or {}
local taken = {}  -- (a msgid twice in one batch: the second is a duplicate)
for j = 1, #ids do
  local i = 7 * j - 5
  local id = ids[j]
  if in_cur[j] == 1 or in_prev[j] == 1 or in_msgs[j] or in_gseen[j] or taken[id] then
    out[#out + 1] = 0
  else
    taken[id] = true
    local at = tonumber(ARGV[i + 3])
    if not pull_only then
      contents[#contents + 1] = id; contents[#contents + 1] = ARGV[i + 1] .. ARGV[i + 2]
      queue(id, at, tonumber(ARGV[i + 4]), ARGV[i + 5])
      if ARGV[i + 6] ~= '' then
        sets[#sets + 1] = field(id, 'tp'); sets[#sets + 1] = ARGV[i + 6]
      end
    end
    if pulled then
      added = (added or log_added(gadded, glog)) + 1
      local kind = read_message(ARGV[i + 1], now)
      append_to_groups(glog, gseen, id, kind, ARGV[i + 2], at, added, ARGV[i + 4], ARGV[i + 5],
                       ARGV[i + 6])
      logged = true
    end
    out[#out + 1] = 1
  end
end
if #contents > 0 then call_all('HSET', msgs, contents) end
if #sets > 0 then call_all('HSET', state, sets) end
if #pushes > 0 then call_all('RPUSH', ready, pushes) end
if logged then
  redis.call('SET', gadded, added)
  redis.call('PUBLISH', glog, now)
end
return out
