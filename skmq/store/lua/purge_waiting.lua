-- pending | delayed | waiting_retry | waiting_key -> gone: an operator's purge (`skmq
-- purge`) of the messages waiting (lib.lua's waiting); in flight and dead ones are left
-- alone. A purged message that was the first of its ordering key lets the next go.
-- KEYS: msgs, state, ready, delayed, kq
-- ARGV: now, limit (0: all), stored at or before this ms (-1: any time), dry run 0|1
-- Returns (delivery id, kind q|t)* purged, oldest first (on a dry run: would be).
local msgs, state, ready, delayed, kq = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local now = tonumber(ARGV[1])
local limit = tonumber(ARGV[2])
local cutoff = tonumber(ARGV[3])
local found = waiting(msgs, state, ready, delayed, kq, now, limit > 0 and limit,
                      cutoff >= 0 and cutoff)
local out = {}
for _, w in ipairs(found) do
  out[#out + 1] = w[1]; out[#out + 1] = (read_message(w[4], now))
end
if ARGV[4] == '1' then return out end
-- Those behind their key first: a key's first message, purged next, then lets go the
-- next one that stays.
for _, w in ipairs(found) do
  if w[2] == 'k' then
    redis.call('ZREM', kq, w[6])
    forget(msgs, state, w[1])
  end
end
for _, w in ipairs(found) do
  local id = w[1]
  if w[2] == 'r' then redis.call('LREM', ready, 1, id) end
  if w[2] == 'd' then redis.call('ZREM', delayed, id) end
  if w[2] ~= 'k' then
    local msgid, crid = split(id)
    if not crid or settle_copy(state, msgid, crid, 'o') then
      advance(state, kq, ready, delayed, msgid, now)
      forget(msgs, state, msgid)
    end
  end
end
return out
