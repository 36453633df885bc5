-- A consumer group subscribes to the app: it reads the group log from `position`
-- (group_position.lua; latest: it gets every message stored after this step); its
-- generation starts (pull_lib.lua). A group that exists already is left as it is.
-- KEYS: as pull_lib.lua, then gadded, gsince. ARGV: group, position.
-- Returns {from, generation} (created: group_position.lua), 0 (it exists already) or -1
-- (a time after Redis's clock).
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 0 end
if redis.call('HLEN', KEYS[1]) == 0 then  -- the app's first group: its log begins
  redis.call('SET', KEYS[10], clock_ms() + 1)
end
local cursor, r, from = start_at(ARGV[2])
if not cursor then return -1 end
return {from, start_group(ARGV[1], cursor, r, nil)}
