-- A consumer group starts again from `latest` (only what is stored from now on) or
-- `earliest` (everything still in the group log); its leases, waits and dead letters go.
-- KEYS: as pull_lib.lua. ARGV: group, latest | earliest. Returns 1, or 0 (no such group).
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
local cursor = '0-0'
if ARGV[2] == 'latest' then
  local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
  if last[1] then cursor = last[1][1] end
end
redis.call('DEL', KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7])
redis.call('HSET', KEYS[1], ARGV[1], cursor)
return 1
