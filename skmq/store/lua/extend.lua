-- in flight (attempt n) -> in flight (attempt n), its lease pushed out: a recipient still
-- working (`arrived` again, or `extend`) gets another lease from now, at most `max` times
-- an attempt. Only while in flight, and only the attempt named.
-- KEYS: msgs, state, inflight
-- ARGV: now, lease ms, max, then (delivery id, attempt or 0 for the current)*
-- Returns (code, extensions so far, deadline ms)*: code 0 not in flight (or another
-- attempt), 1 extended, 2 refused: the attempt had its `max` extensions.
local msgs, state, inflight = KEYS[1], KEYS[2], KEYS[3]
local now = tonumber(ARGV[1])
local lease = tonumber(ARGV[2])
local max = tonumber(ARGV[3])
local out = {}
for i = 4, #ARGV, 2 do
  local id = ARGV[i]
  local want = tonumber(ARGV[i + 1])
  local msgid, crid = split(id)
  local deadline = redis.call('ZSCORE', inflight, id)
  local n = tonumber(redis.call('HGET', state, field(msgid, 'n', crid)) or '0')
  local code, count = 0, 0
  if deadline and (want == 0 or want == n) and redis.call('HEXISTS', msgs, msgid) == 1 then
    -- `l` is "<attempt>:<extensions>": a new attempt starts again from none
    local l = redis.call('HGET', state, field(msgid, 'l', crid))
    if l then
      local a, c = string.match(l, '^(%d+):(%d+)$')
      if tonumber(a) == n then count = tonumber(c) end
    end
    if count >= max then
      code = 2
    else
      code, count = 1, count + 1
      deadline = math.max(tonumber(deadline), now + lease)
      redis.call('ZADD', inflight, deadline, id)
      redis.call('HSET', state, field(msgid, 'l', crid), n .. ':' .. count)
    end
  end
  out[#out + 1] = code; out[#out + 1] = count; out[#out + 1] = tonumber(deadline or 0)
end
return out
