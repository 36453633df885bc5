-- A consumer group starts again from `latest` (only what is stored from now on) or
-- `earliest` (everything still in the group log); its leases, waits and dead letters go,
-- and a new generation starts: no receipt handed out before settles anything after.
-- Waiting receives of the app wake.
-- KEYS: as pull_lib.lua. ARGV: group, latest | earliest. Returns 1, or 0 (no such group).
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
local cursor = '0-0'
if ARGV[2] == 'latest' then
  local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
  if last[1] then cursor = last[1][1] end
end
local old = redis.call('HGET', KEYS[6], '\31g')
redis.call('DEL', KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8])
local gen = clock_us()
if gen == old then gen = gen .. '1' end
redis.call('HSET', KEYS[6], '\31g', gen)
redis.call('HSET', KEYS[1], ARGV[1], cursor)
redis.call('PUBLISH', KEYS[2], gen)  -- (waiting receives wake: `earliest` has work now)
return 1
