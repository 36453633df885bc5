-- Shared by the scripts of recipients, consumer groups and the owners' feed: each script
-- carries the helpers it uses (skmq/store/scripts.py prepends them when it loads the
-- script; skmq/queue/journal.py does the same for skmq/queue/lua/).

local SEP = '\31'

-- redis.call(cmd, key, args...) over a table of arguments built for a whole batch, in
-- chunks (unpack() holds a few thousand values at most; CHUNK is even, so pairs of
-- HSET or ZADD stay together). A batch's reads and writes are each one call, not one a
-- message: in a script, redis.call's own work costs more than most commands it runs.
-- Returns the replies of a command that answers one value an argument, concatenated.
local CHUNK = 960
local function call_all(cmd, key, args)
  if #args <= CHUNK then return redis.call(cmd, key, unpack(args)) end
  local out = {}
  for i = 1, #args, CHUNK do
    local r = redis.call(cmd, key, unpack(args, i, math.min(i + CHUNK - 1, #args)))
    if type(r) == 'table' then
      for j = 1, #r do out[#out + 1] = r[j] end
    end
  end
  return out
end

-- The first message of an ordering key (false: none).
local function key_head(kq, key)
  return redis.call('ZRANGEBYLEX', kq, '[' .. key .. SEP, '(' .. key .. '\32', 'LIMIT', 0, 1)[1]
end

-- A retry backoff in ARGV from index `at`: its length nb, then nb waits (ms). Returns the
-- waits, and the index of the argument after them.
local function backoff_args(at)
  local nb = tonumber(ARGV[at])
  local backoff = {}
  for j = 1, nb do backoff[j] = tonumber(ARGV[at + j]) end
  return backoff, at + 1 + nb
end

-- Redis's clock in microseconds, as a string (Lua's numbers would print it rounded): a
-- consumer group's generation (pull_lib.lua).
local function clock_us()
  local t = redis.call('TIME')
  return t[1] .. string.format('%06d', tonumber(t[2]))
end

-- Redis's clock in unix ms: where a consumer group starts (group_position.lua).
local function clock_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- How many entries were ever added to an app's group log `glog`: its count `gadded`
-- (kept by feed.lua, each entry's `n` its own count); a log from before the count
-- starts it at its length now (set here, so that every script counts from the same).
local function log_added(gadded, glog)
  local n = redis.call('GET', gadded)
  if n then return tonumber(n) end
  n = redis.call('XLEN', glog)
  if n > 0 then redis.call('SET', gadded, n) end
  return n
end

-- One message appended to an app's group log (its fields: pull_lib.lua), its msgid
-- noted in `gseen`: `n` its count among the entries ever added (log_added), x its expiry
-- ('0': none), key its ordering key and trace its traceparent ('': none).
local function append_to_groups(glog, gseen, id, kind, content, at, n, x, key, trace)
  local entry = {'m', id, 'k', kind, 'c', content, 'd', at, 'n', n}
  if x ~= '0' then entry[#entry + 1] = 'x'; entry[#entry + 1] = x end
  if key ~= '' then entry[#entry + 1] = 'o'; entry[#entry + 1] = key end
  if trace ~= '' then entry[#entry + 1] = 't'; entry[#entry + 1] = trace end
  redis.call('HSET', gseen, id, redis.call('XADD', glog, '*', unpack(entry)))
end
