-- received -> pending | delayed | waiting for its key (a msgid stored or completed
-- within the dedupe window: refused as a duplicate). The app joins the apps set in the
-- same step, so that forget.lua can never drop an app between a store and its discovery.
-- A message with a TTL keeps its expiry in `state`; a delayed one falls due at its
-- expiry at the latest (then a claim dead-letters it). A message with an ordering key
-- joins `kq`; it waits there while an earlier message of its key is not over.
-- KEYS: msgs, ready, delayed, apps, state, kq, done:<current bucket>,
--       done:<previous bucket>
-- ARGV: now (13 digits), app, then (msgid, kind q|t, content, deliver_at ms,
--       expires_at ms (0: never), ordering key ('' : none))*
-- Returns 1 (stored) or 0 (duplicate) each.
local msgs, ready, delayed, apps, state = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local kq, cur, prev = KEYS[6], KEYS[7], KEYS[8]
local now = ARGV[1]
redis.call('SADD', apps, ARGV[2])
local out = {}
for i = 3, #ARGV, 6 do
  local id = ARGV[i]
  if redis.call('SISMEMBER', cur, id) == 1 or redis.call('SISMEMBER', prev, id) == 1
      or redis.call('HSETNX', msgs, id, ARGV[i + 1] .. now .. ARGV[i + 2]) == 0 then
    out[#out + 1] = 0
  else
    local at = tonumber(ARGV[i + 3])
    local x = tonumber(ARGV[i + 4])
    local key = ARGV[i + 5]
    if x > 0 then
      redis.call('HSET', state, field(id, 'x'), ARGV[i + 4])
      if at > x then at = x end
    end
    local waits = false
    if key ~= '' then
      waits = key_head(kq, key)
      local seq = redis.call('HINCRBY', state, SEP .. 'kseq', 1)
      local member = key .. SEP .. string.format('%016d', seq) .. SEP .. id
      redis.call('ZADD', kq, 0, member)
      redis.call('HSET', state, field(id, 'k'), member)
    end
    if waits then
      if at > tonumber(now) then redis.call('HSET', state, field(id, 'd'), at) end
    elseif at > tonumber(now) then
      redis.call('ZADD', delayed, at, id)
    else
      redis.call('RPUSH', ready, id)
    end
    out[#out + 1] = 1
  end
end
return out
