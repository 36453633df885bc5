-- No transition: when the app's oldest pending message was stored (-1: none pending),
-- the older of the head of `ready` and the first due in `delayed`: an estimate read at
-- the heads (a retry back in `ready` waits behind younger messages), not a scan.
-- KEYS: msgs, ready, delayed
-- ARGV: now
local msgs, ready, delayed = KEYS[1], KEYS[2], KEYS[3]
local now = tonumber(ARGV[1])
local oldest = -1
local heads = {redis.call('LINDEX', ready, 0),
               redis.call('ZRANGEBYSCORE', delayed, '-inf', now, 'LIMIT', 0, 1)[1]}
for _, id in pairs(heads) do
  local m = id and redis.call('HGET', msgs, (split(id)))
  if m then
    local _, stored = read_message(m, now)
    if oldest < 0 or stored < oldest then oldest = stored end
  end
end
return oldest
