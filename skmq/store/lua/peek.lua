-- No transition: the messages waiting (lib.lua's waiting), for an operator to look at.
-- KEYS: msgs, state, ready, delayed, kq
-- ARGV: now, limit, preview bytes
-- Returns (delivery id, stored ms, attempts, ordering key ('': none), content size,
-- the first preview bytes of the content, due ms (0: due now; -1: never))*.
local msgs, state, ready, delayed, kq = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local now = tonumber(ARGV[1])
local cut = tonumber(ARGV[3])
local out = {}
for _, w in ipairs(waiting(msgs, state, ready, delayed, kq, now, tonumber(ARGV[2]), false)) do
  local id, m, due = w[1], w[4], w[5]
  local msgid, crid = split(id)
  local _, _, at = read_message(m, now)
  local f = redis.call('HMGET', state, field(msgid, 'n', crid), field(msgid, 'k'))
  local key = f[2] and string.sub(f[2], 1, string.find(f[2], SEP, 1, true) - 1) or ''
  if due == math.huge then due = -1 end
  out[#out + 1] = id; out[#out + 1] = w[3]; out[#out + 1] = tonumber(f[1] or '0')
  out[#out + 1] = key; out[#out + 1] = #m - at + 1
  out[#out + 1] = string.sub(m, at, at + cut - 1); out[#out + 1] = due
end
return out
