-- Trim the group log: drop the entries no group needs any more (read by every group, and
-- not leased, delayed or dead in any), and their msgids from `gseen` (so the msgid may
-- be used again). Without groups, the whole log goes (its key and its count `gadded`
-- too, once empty). Entries after a group's cursor never go: its backlog is counted as
-- the entries added after it (skmq/pull/groups.py).
-- The start `gsince` (group_position.lua) moves past the last entry dropped: the log
-- holds every message stored from then on.
-- KEYS: groups, glog, gseen, gadded, gsince, then each group's held (the groups listed
-- in ARGV, in order; a group made or deleted since: this round drops nothing, as a group
-- made from `earliest` or a time reads entries no group listed needs).
-- ARGV: limit (entries at most), then the group names. Returns the entries dropped.
local groups, glog, gseen, gadded, gsince = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local limit = tonumber(ARGV[1])
local function parse(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local function less(a, b)
  local am, as = parse(a)
  local bm, bs = parse(b)
  return am < bm or (am == bm and as < bs)
end
local bound = nil  -- entries below this id go
local found = 0
for i = 2, #ARGV do
  local cursor = redis.call('HGET', groups, ARGV[i])
  if cursor then
    found = found + 1
    -- keep everything after the cursor: the cursor's successor is the bound
    local ms, seq = parse(cursor)
    local keep = ms .. '-' .. (seq + 1)
    -- held is scored by ms: of the entries of the oldest ms, the lowest id
    local oldest = redis.call('ZRANGE', KEYS[4 + i], 0, 0, 'WITHSCORES')
    if oldest[2] then
      for _, held in ipairs(redis.call('ZRANGEBYSCORE', KEYS[4 + i], oldest[2], oldest[2])) do
        if less(held, keep) then keep = held end
      end
    end
    if bound == nil or less(keep, bound) then bound = keep end
  end
end
-- the groups listed are not the groups there are (made or deleted since): next round
if found ~= #ARGV - 1 or redis.call('HLEN', groups) ~= found then return 0 end
local entries
if bound == nil then
  entries = redis.call('XRANGE', glog, '-', '+', 'COUNT', limit)
else
  entries = redis.call('XRANGE', glog, '-', '(' .. bound, 'COUNT', limit)
end
for _, e in ipairs(entries) do
  local f = e[2]
  for j = 1, #f, 2 do
    if f[j] == 'm' then redis.call('HDEL', gseen, f[j + 1]) end
  end
  redis.call('XDEL', glog, e[1])
end
if #entries > 0 then
  redis.call('SET', gsince, (parse(entries[#entries][1])) + 1)
end
if bound == nil and redis.call('XLEN', glog) == 0 then redis.call('DEL', glog, gadded, gsince) end
return #entries
