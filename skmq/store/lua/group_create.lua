-- A consumer group subscribes to the app: it reads the group log from its end, so it gets
-- every message stored after this step; its generation starts (pull_lib.lua).
-- KEYS: as pull_lib.lua. ARGV: group. Returns 1 (created) or 0 (it exists already).
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 0 end
local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
local cursor = '0-0'
if last[1] then cursor = last[1][1] end
redis.call('HSET', KEYS[6], '\31g', clock_us())
redis.call('HSET', KEYS[1], ARGV[1], cursor)
return 1
