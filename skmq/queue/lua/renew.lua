-- Extend the lease of the owner of an epoch, while that epoch is current: a lease run
-- out that nobody took over is ours again; one taken over (the epoch moved on) is lost.
-- KEYS: owner, epoch
-- ARGV: "<broker>:<epoch>", epoch, lease ms
-- Returns 1 (held until now + lease) or 0 (lost: the caller drops the queue).
if redis.call('GET', KEYS[2]) ~= ARGV[2] then return 0 end
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
return 1
