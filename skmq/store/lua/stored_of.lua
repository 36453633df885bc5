-- No transition: what became of messages whose store's answer was lost (a timeout, a
-- connection dropped mid-call): stored, completed since, or not stored.
-- KEYS: msgs, done:<current bucket>, done:<previous bucket>
-- ARGV: now, then msgids. Returns each one's stored ms, -1 (completed within the dedupe
-- window) or 0 (not stored).
local msgs, cur, prev = KEYS[1], KEYS[2], KEYS[3]
local now = tonumber(ARGV[1])
local out = {}
for i = 2, #ARGV do
  local m = redis.call('HGET', msgs, ARGV[i])
  if m then
    local _, stored = read_message(m, now)
    out[#out + 1] = stored
  elseif redis.call('SISMEMBER', cur, ARGV[i]) == 1
      or redis.call('SISMEMBER', prev, ARGV[i]) == 1 then
    out[#out + 1] = -1
  else
    out[#out + 1] = 0
  end
end
return out
