-- in flight (attempt n, lease running) -> acked, for one consumer group. A receipt of an
-- earlier attempt, or whose lease ran out, is refused: it never settles a redelivery.
-- KEYS, ARGV: as pull_lib.lua, then receipts (entry id, n, generation)*. Returns, for
-- each, the attempt it acked (since the entry's last replay), or 0 (refused).
return each_live(3, function(id)
  redis.call('ZREM', inflight, id)
  redis.call('ZREM', held, id)
  forget_entry(id)
  release(id)
end)
