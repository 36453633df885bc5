-- in flight (attempt n, lease running) -> in flight, its lease now + the ms given.
-- KEYS, ARGV: as pull_lib.lua, then (entry id, attempt, generation, ms)*. Returns 1 or 0 each.
return each_live(4, function(id, ms)
  redis.call('ZADD', inflight, 'XX', now + tonumber(ms), id)
end)
