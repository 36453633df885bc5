-- A consumer group unsubscribes: its cursor and every key of it go. With the app's last
-- group the group log goes too (its msgids `gseen`, count `gadded` and start `gsince`:
-- group_position.lua), as a trim round would drop it: a group made later starts a log of
-- its own, and its `earliest` is no message stored while the app had no group (none of
-- those is in the log).
-- KEYS: as pull_lib.lua, then gseen, gadded, gsince. ARGV: group.
-- Returns 1, or 0 (no such group).
redis.call('DEL', KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8])
local deleted = redis.call('HDEL', KEYS[1], ARGV[1])
if redis.call('HLEN', KEYS[1]) == 0 then
  redis.call('UNLINK', KEYS[2], KEYS[9], KEYS[10], KEYS[11])
end
return deleted
