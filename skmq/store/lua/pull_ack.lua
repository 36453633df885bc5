-- in flight (attempt n, lease running) -> acked, for one consumer group. A receipt of an
-- earlier attempt, or whose lease ran out, is refused: it never settles a redelivery.
-- KEYS, ARGV: as pull_lib.lua, then (entry id, attempt, generation)*. Returns 1 (acked)
-- or 0 each.
return each_live(3, function(id)
  redis.call('ZREM', inflight, id)
  redis.call('ZREM', held, id)
  forget_entry(id)
  release(id)
end)
