-- Forget an app that holds nothing: no recipient, no consumer group and no message
-- ready, delayed, in flight or dead. Its leftovers and its `listed` mark go in one step;
-- the store then takes it out of the apps directory (another node in a cluster) and
-- lists it again if a store or a registration set the mark meanwhile
-- (skmq/store/directory.py).
-- KEYS: ready, delayed, inflight, dead, recipients, msgs, state, rstate, rbeat, rate, listed,
--       groups, tally
-- Returns 1 if forgotten.
if redis.call('LLEN', KEYS[1]) > 0 or redis.call('ZCARD', KEYS[2]) > 0
    or redis.call('ZCARD', KEYS[3]) > 0 or redis.call('ZCARD', KEYS[4]) > 0
    or redis.call('HLEN', KEYS[5]) > 0 or redis.call('HLEN', KEYS[12]) > 0 then
  return 0
end
redis.call('DEL', KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10], KEYS[11], KEYS[13])
return 1
