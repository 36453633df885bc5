-- dead -> gone for good. Anything not dead is refused.
-- KEYS: msgs, state, dead
-- ARGV: delivery ids. Returns 1 (purged) or 0 (not dead) each.
local msgs, state, dead = KEYS[1], KEYS[2], KEYS[3]
local out = {}
for i = 1, #ARGV do
  local id = ARGV[i]
  if redis.call('ZREM', dead, id) == 1 then
    local msgid, crid = split(id)
    local gone = true
    if crid then
      redis.call('HDEL', state, field(msgid, 'n', crid), field(msgid, 'h', crid),
                 field(msgid, 'e', crid))
      local dc = redis.call('HINCRBY', state, field(msgid, 'dc'), -1)
      local o = tonumber(redis.call('HGET', state, field(msgid, 'o')) or '0')
      gone = o <= 0 and dc <= 0
    end
    if gone then forget(msgs, state, msgid) end
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
