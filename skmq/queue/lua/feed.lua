-- Prepended to flush.lua and append.lua: the app's consumer groups (skmq/pull/) fed
-- with its stored messages. Once the app has a group, a stored message
-- is also appended to the group log `glog` (each entry's `n` counting the entries ever
-- added, kept in `gadded`; its msgid in `gseen`), and the log's channel is told; while
-- no push recipient is registered it goes to the groups alone (pull only: neither log
-- nor inbox, and so no owner, holds it). A msgid still in the group log is a duplicate.
-- The group log's fields: m msgid, k kind q|t, c content, d deliver_at ms (0: now),
-- x expires ms (only with a TTL), o ordering key (only with one), t traceparent (only
-- with one).

-- The groups' state for a batch of msgids, or nil where the app has no group.
local function groups_of(groups, recipients, glog, gseen, gadded, ids)
  if redis.call('HLEN', groups) == 0 then return nil end
  return {glog = glog, gseen = gseen, gadded = gadded,
          seen = redis.call('HMGET', gseen, unpack(ids)),
          pull_only = redis.call('HLEN', recipients) == 0}
end

-- One message appended to the group log (its header: skmq/queue/entries.py).
local function feed(g, id, content, header)
  local kind, at, x, key, trace = 'q', '0', '0', '', ''
  if header ~= '' then
    local parts = {}
    for part in string.gmatch(header .. '\31', '(.-)\31') do parts[#parts + 1] = part end
    kind, at, x, key, trace = parts[1], parts[2], parts[3], parts[4], parts[5]
  end
  g.added = (g.added or log_added(g.gadded, g.glog)) + 1
  append_to_groups(g.glog, g.gseen, id, kind, content, at, g.added, x, key, trace)
end

-- After the batch: the count kept, the groups' long polls told.
local function fed(g, now)
  if g and g.added then
    redis.call('SET', g.gadded, g.added)
    redis.call('PUBLISH', g.glog, now)
  end
end
