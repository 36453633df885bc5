-- received -> pending | delayed (a msgid stored or completed within the dedupe window:
-- refused as a duplicate). The app joins the apps set in the same step, so that
-- forget.lua can never drop an app between a store and its discovery. A message with a
-- TTL keeps its expiry in `state`; a delayed one falls due at its expiry at the latest
-- (then a claim dead-letters it).
-- KEYS: msgs, ready, delayed, apps, state, done:<current bucket>, done:<previous bucket>
-- ARGV: now (13 digits), app, then (msgid, kind q|t, content, deliver_at ms,
--       expires_at ms (0: never))*
-- Returns 1 (stored) or 0 (duplicate) each.
local msgs, ready, delayed, apps, state = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local cur, prev = KEYS[6], KEYS[7]
local now = ARGV[1]
redis.call('SADD', apps, ARGV[2])
local out = {}
for i = 3, #ARGV, 5 do
  local id = ARGV[i]
  if redis.call('SISMEMBER', cur, id) == 1 or redis.call('SISMEMBER', prev, id) == 1
      or redis.call('HSETNX', msgs, id, ARGV[i + 1] .. now .. ARGV[i + 2]) == 0 then
    out[#out + 1] = 0
  else
    local at = tonumber(ARGV[i + 3])
    local x = tonumber(ARGV[i + 4])
    if x > 0 then
      redis.call('HSET', state, field(id, 'x'), ARGV[i + 4])
      if at > x then at = x end
    end
    if at > tonumber(now) then
      redis.call('ZADD', delayed, at, id)
    else
      redis.call('RPUSH', ready, id)
    end
    out[#out + 1] = 1
  end
end
return out
