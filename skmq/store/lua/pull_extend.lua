-- in flight (attempt n, lease running) -> in flight, its lease now + the ms given.
-- KEYS, ARGV: as pull_lib.lua, then (entry id, attempt, ms)*. Returns 1 or 0 each.
local out = {}
for i = rest, #ARGV, 3 do
  local id = ARGV[i]
  if live(id, tonumber(ARGV[i + 1])) then
    redis.call('ZADD', inflight, 'XX', now + tonumber(ARGV[i + 2]), id)
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
