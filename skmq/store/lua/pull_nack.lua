-- in flight (attempt n, lease running) -> waiting retry | dead, for one consumer group:
-- a failed attempt, retried after the wait given (or the backoff), dead after retry_times.
-- A retry is announced on the group log's channel: waiting receives wake, and learn
-- when it falls due (a delayed retry may come before what they wait for).
-- KEYS, ARGV: as pull_lib.lua, then (entry id, n, generation, wait ms or -1)*.
-- Returns (code 0 refused | 1 retry | 2 dead, due ms, the attempt that failed (since the
-- entry's last replay))*.
local out = {}
local wake = false
for i = rest, #ARGV, 4 do
  local id, n = ARGV[i], tonumber(ARGV[i + 1])
  if live(id, n, ARGV[i + 2]) then
    local attempt = since_replay(id, n)
    local r = fail_attempt(id, 'nack', tonumber(ARGV[i + 3]), now)
    out[#out + 1] = r[1]; out[#out + 1] = r[2]; out[#out + 1] = attempt
    if r[1] == 1 then wake = true end
  else
    out[#out + 1] = 0; out[#out + 1] = 0; out[#out + 1] = 0
  end
end
if wake then redis.call('PUBLISH', glog, now) end
return out
