-- dead -> gone for good. Anything not dead is refused.
-- KEYS: msgs, state, dead
-- ARGV: delivery ids. Returns 1 (purged) or 0 (not dead) each.
local msgs, state, dead = KEYS[1], KEYS[2], KEYS[3]
return each_id(1, function(id)
  if redis.call('ZREM', dead, id) == 0 then return false end
  local msgid, crid = split(id)
  if not crid or settle_copy(state, msgid, crid, 'dc') then forget(msgs, state, msgid) end
  return true
end)
