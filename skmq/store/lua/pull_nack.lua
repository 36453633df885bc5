-- in flight (attempt n, lease running) -> waiting retry | dead, for one consumer group:
-- a failed attempt, retried after the wait given (or the backoff), dead after retry_times.
-- A retry due at once is announced on the group log's channel (waiting receives wake).
-- KEYS, ARGV: as pull_lib.lua, then (entry id, attempt, generation, wait ms or -1)*.
-- Returns (code 0 refused | 1 retry | 2 dead, due ms)*.
local out = {}
local wake = false
for i = rest, #ARGV, 4 do
  local id = ARGV[i]
  if live(id, tonumber(ARGV[i + 1]), ARGV[i + 2]) then
    local r = fail_attempt(id, 'nack', tonumber(ARGV[i + 3]))
    out[#out + 1] = r[1]; out[#out + 1] = r[2]
    if r[1] == 1 and r[2] <= now then wake = true end
  else
    out[#out + 1] = 0; out[#out + 1] = 0
  end
end
if wake then redis.call('PUBLISH', glog, now) end
return out
