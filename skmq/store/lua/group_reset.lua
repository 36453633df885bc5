-- A consumer group starts again from `position` (group_position.lua: latest, only what
-- is stored from now on; earliest, everything still in the group log; or a time); its
-- leases, waits and dead letters go, and a new generation starts: no receipt handed out
-- before settles anything after. Waiting receives of the app wake.
-- KEYS: as pull_lib.lua, then gadded, gsince. ARGV: group, position.
-- Returns {from, generation} (group_position.lua), 0 (no such group) or -1 (a time after
-- Redis's clock: nothing done).
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
local cursor, r, from = start_at(ARGV[2])
if not cursor then return -1 end
local old = redis.call('HGET', KEYS[6], '\31g')
redis.call('DEL', KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8])
local gen = start_group(ARGV[1], cursor, r, old)
redis.call('PUBLISH', KEYS[2], gen)  -- (waiting receives wake: the group may have work now)
return {from, gen}
