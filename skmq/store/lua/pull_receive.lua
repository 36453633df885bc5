-- pending | delayed | waiting retry -> in flight (attempt n + 1), for one consumer group;
-- first, the group's leases that ran out -> waiting retry | dead (a failed attempt).
-- KEYS, ARGV: as pull_lib.lua, then group, max, visibility ms.
-- Returns (entry id, msgid, kind q|t, content, attempt)*, then the group's generation and
-- the ms at which the next delayed entry falls due or a lease runs out (-1: none);
-- {'no group'}: no such group.
local group, max, vis = ARGV[rest], tonumber(ARGV[rest + 1]), tonumber(ARGV[rest + 2])
local cursor = redis.call('HGET', groups, group)
if not cursor then return {'no group'} end
local ran_out = redis.call('ZRANGEBYSCORE', inflight, '-inf', '(' .. now, 'LIMIT', 0, 1000)
for _, id in ipairs(ran_out) do fail_attempt(id, 'timeout: lease ran out', -1) end

local out = {}
local taken = 0
local function ms(id) return tonumber(string.match(id, '^(%d+)')) end
local function fields(flat)
  local f = {}
  for j = 1, #flat, 2 do f[flat[j]] = flat[j + 1] end
  return f
end
local function lease(id, f)
  local n = redis.call('HINCRBY', gstate, nfield(id), 1)
  redis.call('ZADD', inflight, now + vis, id)
  redis.call('ZADD', held, ms(id), id)
  out[#out + 1] = id; out[#out + 1] = f.m; out[#out + 1] = f.k; out[#out + 1] = f.c
  out[#out + 1] = n
  taken = taken + 1
end

for _, id in ipairs(redis.call('ZRANGEBYSCORE', delayed, '-inf', now, 'LIMIT', 0, max)) do
  redis.call('ZREM', delayed, id)
  local e = redis.call('XRANGE', glog, id, id)
  if e[1] then
    lease(id, fields(e[1][2]))
  else  -- gone from the log (never while held): forget it
    redis.call('ZREM', held, id)
    redis.call('HDEL', gstate, nfield(id), efield(id))
  end
end
local scanned = 0
while taken < max and scanned < 1000 do
  local entries = redis.call('XRANGE', glog, '(' .. cursor, '+', 'COUNT', max - taken)
  if #entries == 0 then break end
  for _, e in ipairs(entries) do
    cursor = e[1]
    scanned = scanned + 1
    local f = fields(e[2])
    local due = tonumber(f.d or '0')
    if due > now then
      redis.call('ZADD', delayed, due, cursor)
      redis.call('ZADD', held, ms(cursor), cursor)
    else
      lease(cursor, f)
    end
  end
end
redis.call('HSET', groups, group, cursor)

local nxt = -1
local d = redis.call('ZRANGE', delayed, 0, 0, 'WITHSCORES')
if d[2] then nxt = tonumber(d[2]) end
local l = redis.call('ZRANGE', inflight, 0, 0, 'WITHSCORES')
if l[2] and (nxt < 0 or tonumber(l[2]) + 1 < nxt) then nxt = tonumber(l[2]) + 1 end
out[#out + 1] = generation()
out[#out + 1] = nxt
return out
