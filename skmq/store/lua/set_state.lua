-- A recipient alive or lost (heartbeats, connection outcomes).
-- KEYS: recipients, rstate, rbeat
-- ARGV: rid, state (1 alive | 0 lost), now. Returns the previous state, or -1 when the
-- recipient is not registered (then nothing is written).
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return -1 end
local old = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '1')
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
if ARGV[2] == '1' then redis.call('HSET', KEYS[3], ARGV[1], ARGV[3]) end
return old
