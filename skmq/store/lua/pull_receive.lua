-- pending | delayed | waiting retry -> in flight (attempt n + 1), for one consumer group,
-- or -> dead | gone when its TTL ran out (expired: never handed out; gone when drop is 1);
-- pending -> waiting for its key, while an earlier entry of its ordering key is not over;
-- first, the group's leases that ran out -> waiting retry | dead (a failed attempt).
-- KEYS, ARGV: as pull_lib.lua, then group, max, visibility ms, drop 0|1.
-- A call reads at most SCAN new log entries (a long run of delayed entries, or of entries
-- waiting for their key, must not hold Redis): then it says `more`, and the caller calls
-- again at once rather than wait.
-- Returns (entry id, msgid, kind q|t, content, n for its receipt, attempt since its last
-- replay, traceparent ('': none))*, an expired entry with kind xq|xt and content `dead` or `drop` (attempts:
-- those before), a lease that ran out with kind rq|rt and content `dead` or the ms its
-- retry falls due (n and attempt: the attempt that failed; logged by the broker, as a
-- timed-out push is), then the log entries the group has not read yet (-1: not known, a
-- group or entries from before the counts), the group's generation,
-- the ms at which the next delayed entry falls due or a lease runs out (-1: none) and
-- `more` (1|0); {'no group'}: no such group.
local group, max, vis = ARGV[rest], tonumber(ARGV[rest + 1]), tonumber(ARGV[rest + 2])
local drop = ARGV[rest + 3] == '1'
local SCAN = 1000
local cursor = redis.call('HGET', groups, group)
if not cursor then return {'no group'} end
local out = {}
local taken = 0
local function ms(id) return string.match(id, '^(%d+)') end  -- (as text: a score)
-- When an entry falls due: its delay, or its expiry if that comes first.
local function due_of(id, f)
  local due, x = tonumber(f.d or '0'), expires(id, f)
  if x > 0 and due > x then return x end
  return due
end
-- Whether an entry read from the log for the first time may go now: not while an
-- earlier entry of its ordering key is not over (it then waits in `kq`).
local function admitted(id, f)
  if not f.o then return true end
  local ms_part, seq = string.match(id, '^(%d+)-(%d+)$')
  local member = f.o .. SEP .. string.rep('0', 20 - #ms_part) .. ms_part
    .. string.rep('0', 20 - #seq) .. seq .. SEP .. id
  local first = key_head(gkq, f.o) == nil
  redis.call('ZADD', gkq, 0, member)
  redis.call('HSET', gstate, ofield(id), member)
  return first
end
-- (attempt: since its last replay; read here unless the caller read it with others)
local function emit(id, f, kind, content, n, attempt)
  local i = #out
  out[i + 1] = id; out[i + 2] = f.m; out[i + 3] = kind; out[i + 4] = content
  out[i + 5] = n; out[i + 6] = attempt or since_replay(id, n); out[i + 7] = f.t or ''
end
-- The group's leases that ran out: each a failed attempt (retried, or dead on its last).
local ran_out = redis.call('ZRANGEBYSCORE', inflight, '-inf', '(' .. now, 'WITHSCORES',
                          'LIMIT', 0, 1000)
for i = 1, #ran_out, 2 do
  local id = ran_out[i]
  local n = tonumber(redis.call('HGET', gstate, nfield(id)) or '0')
  local r = fail_attempt(id, 'timeout: lease ran out', -1, tonumber(ran_out[i + 1]))
  local e = redis.call('XRANGE', glog, id, id)[1]
  if e then
    local f = fields(e[2])
    emit(id, f, 'r' .. f.k, r[1] == 2 and 'dead' or string.format('%d', math.floor(r[2])), n)
  end
end
local function expire(id, f)
  local n = tonumber(redis.call('HGET', gstate, nfield(id)) or '0')
  if drop then
    redis.call('ZREM', held, id)
    forget_entry(id)
  else
    redis.call('ZADD', dead, now, id)
    redis.call('ZADD', held, ms(id), id)
    redis.call('HSET', gstate, efield(id), 'expired: its ttl ran out before it was pulled')
    not_plain()
  end
  release(id)
  emit(id, f, 'x' .. f.k, drop and 'drop' or 'dead', n)
end
-- The entries this call hands out: leased at its end, in one call a key (not a few a
-- message), and returned in the order they were taken. An entry read from the log for
-- the first time (`fresh`) has no attempts yet: the group's cursor only moves on, and a
-- reset or a new group starts with no entry's fields. Only the others' are read.
local leasing, again = {}, {}
local function lease(id, f, fresh)
  local x = expires(id, f)
  if x > 0 and now >= x then return expire(id, f) end
  leasing[#leasing + 1] = {id, f}
  if not fresh then again[#again + 1] = #leasing end
  taken = taken + 1
end
local function lease_all()
  if #leasing == 0 then return end
  local ns, bs = {}, {}
  if #again > 0 then
    local nf, bf = {}, {}
    for j, at in ipairs(again) do nf[j] = nfield(leasing[at][1]); bf[j] = bfield(leasing[at][1]) end
    local n_again, b_again = call_all('HMGET', gstate, nf), call_all('HMGET', gstate, bf)
    for j, at in ipairs(again) do ns[at] = n_again[j]; bs[at] = b_again[j] end
  end
  -- (the commands' arguments as text: Redis formats a Lua number with sprintf)
  local counts, leases, needed = {}, {}, {}
  local deadline = string.format('%d', now + vis)
  for j, l in ipairs(leasing) do
    local id, f = l[1], l[2]
    local n = tonumber(ns[j] or '0') + 1
    local i = 2 * j
    counts[i - 1] = nfield(id); counts[i] = n == 1 and '1' or string.format('%d', n)
    leases[i - 1] = deadline; leases[i] = id
    needed[i - 1] = ms(id); needed[i] = id
    emit(id, f, f.k, f.c, n, n - tonumber(bs[j] or '0'))
  end
  call_all('HSET', gstate, counts)
  call_all('ZADD', inflight, leases)
  call_all('ZADD', held, needed)
end

for _, id in ipairs(redis.call('ZRANGEBYSCORE', delayed, '-inf', now, 'LIMIT', 0, max)) do
  redis.call('ZREM', delayed, id)
  local e = redis.call('XRANGE', glog, id, id)
  if not e[1] then  -- gone from the log (never while held): forget it
    redis.call('ZREM', held, id)
    forget_entry(id)
    release(id)
  else
    local f = fields(e[1][2])
    local due = due_of(id, f)  -- (an entry let go by its key: due now, or at its own delay)
    if due > now then redis.call('ZADD', delayed, due, id) else lease(id, f, false) end
  end
end
local scanned = 0
local more = 0  -- 1: the scan stopped at its bound with log entries left to read
-- entries ever added to the log up to the cursor (group_position.lua): an entry's own
-- count, or one more than the entry before for one from before entries had it
local read = redis.call('HGET', gstate, '\31r')
read = read and tonumber(read)
while taken < max do
  if scanned >= SCAN then more = 1; break end
  local entries = redis.call('XRANGE', glog, '(' .. cursor, '+', 'COUNT', max - taken)
  if #entries == 0 then break end
  for _, e in ipairs(entries) do
    cursor = e[1]
    scanned = scanned + 1
    local f = fields(e[2])
    if f.n then read = tonumber(f.n) elseif read then read = read + 1 end
    local due = due_of(cursor, f)
    if not admitted(cursor, f) then
      redis.call('ZADD', held, ms(cursor), cursor)
    elseif due > now then
      redis.call('ZADD', delayed, due, cursor)
      redis.call('ZADD', held, ms(cursor), cursor)
    else
      lease(cursor, f, true)
    end
  end
end
lease_all()
redis.call('HSET', groups, group, cursor)
if read and scanned > 0 then redis.call('HSET', gstate, '\31r', read) end

local nxt = -1
local d = redis.call('ZRANGE', delayed, 0, 0, 'WITHSCORES')
if d[2] then nxt = tonumber(d[2]) end
local l = redis.call('ZRANGE', inflight, 0, 0, 'WITHSCORES')
if l[2] and (nxt < 0 or tonumber(l[2]) + 1 < nxt) then nxt = tonumber(l[2]) + 1 end
local unread = -1
local last = redis.call('XREVRANGE', glog, '+', '-', 'COUNT', 1)[1]
if not last then
  unread = 0
elseif last[1] == cursor then
  unread = 0
elseif read then
  local n = fields(last[2]).n
  if n then unread = math.max(0, tonumber(n) - read) end
end
out[#out + 1] = unread
out[#out + 1] = generation()
out[#out + 1] = nxt
out[#out + 1] = more
return out
