-- in flight (attempt n) -> waiting retry | dead: leases that ran out (the broker that
-- pushed died, or never heard back) count as timeouts.
-- KEYS, ARGV: as retry.lua (ARGV[2]: how many at most). Returns (id, code, attempt, due, rid)*.
local ids = redis.call('ZRANGEBYSCORE', inflight, '-inf', now, 'LIMIT', 0, tonumber(ARGV[2]))
local out = {}
for _, id in ipairs(ids) do
  local r = fail_one(id, 'timeout', 'no final answer within ack_timeout', '', 0)
  out[#out + 1] = id
  for _, v in ipairs(r) do out[#out + 1] = v end
end
return out
