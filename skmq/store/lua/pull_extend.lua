-- in flight (attempt n, lease running) -> in flight, its lease now + the ms given.
-- A lease made shorter is announced on the group log's channel: waiting receives wake,
-- and learn that it runs out sooner than they thought.
-- KEYS, ARGV: as pull_lib.lua, then (entry id, n, generation, ms)*. Returns, for each,
-- the attempt extended (since the entry's last replay), or 0 (refused).
local sooner = false
local out = each_live(4, function(id, ms)
  local deadline = now + tonumber(ms)
  if deadline < tonumber(redis.call('ZSCORE', inflight, id)) then sooner = true end
  redis.call('ZADD', inflight, 'XX', deadline, id)
end)
if sooner then redis.call('PUBLISH', glog, now) end
return out
