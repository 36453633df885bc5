-- received -> pending | delayed (a msgid stored or completed within the dedupe window:
-- refused as a duplicate). The app joins the apps set in the same step, so that
-- forget.lua can never drop an app between a store and its discovery.
-- KEYS: msgs, ready, delayed, apps, done:<current bucket>, done:<previous bucket>
-- ARGV: now (13 digits), app, then (msgid, kind q|t, content, deliver_at ms)*
-- Returns 1 (stored) or 0 (duplicate) each.
local msgs, ready, delayed, apps = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local cur, prev = KEYS[5], KEYS[6]
local now = ARGV[1]
redis.call('SADD', apps, ARGV[2])
local out = {}
for i = 3, #ARGV, 4 do
  local id = ARGV[i]
  if redis.call('SISMEMBER', cur, id) == 1 or redis.call('SISMEMBER', prev, id) == 1
      or redis.call('HSETNX', msgs, id, ARGV[i + 1] .. now .. ARGV[i + 2]) == 0 then
    out[#out + 1] = 0
  else
    local at = tonumber(ARGV[i + 3])
    if at > tonumber(now) then
      redis.call('ZADD', delayed, at, id)
    else
      redis.call('RPUSH', ready, id)
    end
    out[#out + 1] = 1
  end
end
return out
