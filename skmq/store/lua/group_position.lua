-- Where a consumer group starts reading the group log (group_create, group_reset): its
-- cursor (the last entry it has read) and, in its gstate, `\31r`: how many entries were
-- ever added to the log up to its cursor. Entries after a cursor are never trimmed, so
-- the group's backlog is `gadded` - r (skmq/pull/groups.py); pull_receive.lua moves r on
-- with the cursor.
-- KEYS: as pull_lib.lua, then gadded, gsince. Position (skmq/pull/position.py): latest,
-- earliest or a time in unix ms (the entries stored at or after it: their ids' ms).
-- The start is also told as a time (`from`, unix ms, Redis's clock) for the delivery
-- log: the group gets the messages stored from then on (docs/AUDIT.md). It errs towards
-- later, so that no message the group never gets is counted its: latest is the ms after
-- now; earliest `gsince`, from when the log holds every message stored (the ms after the
-- app's first group was made, moved on past each entry trimmed: group_trim.lua), else
-- (a log from before it) the ms after its first entry.
local gadded, gsince = KEYS[9], KEYS[10]
local READ = '\31r'

-- The n of a log entry (XRANGE's form), nil for one from before entries had it.
local function entry_n(e)
  local f = e[2]
  for j = 1, #f, 2 do
    if f[j] == 'n' then return tonumber(f[j + 1]) end
  end
  return nil
end

local function ms_of(id)
  return tonumber(string.match(id, '^(%d+)'))
end

-- cursor, r (nil: not known, for an entry from before entries had n), from, for
-- `position`; nil when the time is after Redis's clock (the log cannot skip what comes
-- before it).
local function start_at(position)
  local total = log_added(gadded, KEYS[2])
  local now = clock_ms()
  if position == 'latest' then
    local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)[1]
    return last and last[1] or '0-0', total, now + 1
  end
  local first = redis.call('XRANGE', KEYS[2], '-', '+', 'COUNT', 1)[1]
  local from = tonumber(redis.call('GET', gsince))
  if not from then from = first and ms_of(first[1]) + 1 or now + 1 end
  local before = nil
  if position ~= 'earliest' then
    if tonumber(position) > now then return nil end
    from = math.max(from, tonumber(position))
    if position ~= '0' then  -- the last entry before the time
      before = redis.call('XREVRANGE', KEYS[2], '(' .. position .. '-0', '-', 'COUNT', 1)[1]
    end
  end
  if before then return before[1], entry_n(before), from end
  return '0-0', total - redis.call('XLEN', KEYS[2]), from
end

-- The group (gstate cleared) starts at `cursor`, with r (nil: not known) and a new
-- generation (different from `old`, the one before, if any).
local function start_group(group, cursor, r, old)
  local gen = clock_us()
  if gen == old then gen = gen .. '1' end
  redis.call('HSET', KEYS[6], '\31g', gen, '\31p', 1)  -- (\31p: pull_lib.lua)
  if r then redis.call('HSET', KEYS[6], READ, r) end
  redis.call('HSET', KEYS[1], group, cursor)
  return gen
end
