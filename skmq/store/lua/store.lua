-- received -> pending | delayed (a msgid stored or completed within the dedupe window:
-- refused as a duplicate). The app's `listed` mark is set in the same step: the store
-- (skmq/store/directory.py) then lists the app in the apps directory when the mark is
-- new, and a forget that raced with this store finds the mark and lists it again.
-- KEYS: msgs, ready, delayed, listed, done:<current bucket>, done:<previous bucket>
-- ARGV: now (13 digits), then (msgid, kind q|t, content, deliver_at ms)*
-- Returns 1 if the mark is new (else 0), then 1 (stored) or 0 (duplicate) a message.
local msgs, ready, delayed, listed = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local cur, prev = KEYS[5], KEYS[6]
local now = ARGV[1]
local out = {redis.call('SET', listed, 1, 'NX') and 1 or 0}
for i = 2, #ARGV, 4 do
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
