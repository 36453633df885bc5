-- Forget an app that holds nothing: no recipient and no message ready, delayed, in
-- flight or dead. Its leftovers go and it leaves the apps set, in one step, so that no
-- store (which adds the app to the set in its own step) can fall between.
-- KEYS: ready, delayed, inflight, dead, recipients, msgs, state, rstate, rbeat, rate, apps
-- ARGV: app. Returns 1 if forgotten.
if redis.call('LLEN', KEYS[1]) > 0 or redis.call('ZCARD', KEYS[2]) > 0
    or redis.call('ZCARD', KEYS[3]) > 0 or redis.call('ZCARD', KEYS[4]) > 0
    or redis.call('HLEN', KEYS[5]) > 0 then
  return 0
end
redis.call('DEL', KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10])
return redis.call('SREM', KEYS[11], ARGV[1])
