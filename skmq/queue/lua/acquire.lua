-- Take the app's queue: only while nobody holds its lease (or we do). A takeover
-- increments the epoch, so that every write of an earlier owner is refused from now on.
-- KEYS: owner, epoch
-- ARGV: broker id, lease ms
-- Returns {1, epoch} when the queue is ours, {0, holder ("<broker>:<epoch>"), the ms its
-- lease has left} when not.
local holder = redis.call('GET', KEYS[1])
if holder and string.sub(holder, 1, #ARGV[1] + 1) ~= ARGV[1] .. ':' then
  return {0, holder, redis.call('PTTL', KEYS[1])}
end
local epoch = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. epoch, 'PX', ARGV[2])
return {1, epoch}
