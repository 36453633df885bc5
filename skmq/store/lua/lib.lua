-- Shared by every message transition: each script carries the helpers it uses
-- (skmq/store/scripts.py prepends them when it loads the script).
--
-- A msgid below is as the store holds it: its text, or, for 32 hex digits in a packed
-- store, \0 and the 16 bytes (skmq/store/msgids.py); only split() looks inside one.
-- One app's keys, all under the app's hash tag, all passed in KEYS by the caller:
--   msgs      HASH  msgid -> a header (the kind, q|t, and the stored ms), then the
--                   content (skmq/store/messages.py; read_message reads it)
--   state     HASH  delivery state, created at the first claim, one field an attribute:
--                   <msgid>\31<attr> or, for one recipient's copy of a topic message,
--                   <msgid>\31<attr>\31<rid>; attrs: n attempts, r last recipient,
--                   e last error, h history, o copies outstanding, dc copies dead,
--                   c the recipients a topic message was fanned out to (\31-joined),
--                   x when the message expires (unix ms; TTL, set when stored),
--                   l lease extensions of the current attempt (<attempt>:<count>),
--                   k its place in `kq` (an ordered message), d when a message
--                   waiting for its key falls due; and one counter, \31kseq
--   kq        ZSET  ordered messages (`key=`), all scored 0, member
--                   <key>\31<16-digit sequence>\31<msgid>: by key, then in stored
--                   order. A key's first member is the one message of that key in
--                   ready, delayed, in flight or waiting for a retry; the others wait
--                   here until it is acked or dead.
--   ready     LIST  delivery ids ready to push, FIFO
--   delayed   ZSET  delivery id -> due ms (delayed messages, retry waits, replays)
--   inflight  ZSET  delivery id -> lease deadline ms (pushed, waiting for an answer)
--   dead      ZSET  delivery id -> ms it died (the dead-letter queue)
--   done:<b>  SET   msgids completed in time bucket b (dedupe after completion)
-- A delivery id is the msgid (a queue message, or a topic message not yet fanned out)
-- or <msgid>\31<rid> (one recipient's copy). No id holds \31 (a control character),
-- but a packed msgid may (skmq/store/msgids.py: \0 and 16 bytes): that one is 17 bytes.

local SEP = '\31'

local function split(id)
  local p
  if string.byte(id, 1) == 0 then p = 18 else p = string.find(id, SEP, 1, true) end
  if p and p <= #id then return string.sub(id, 1, p - 1), string.sub(id, p + 1) end
  return id, nil
end

-- A `msgs` value's kind (q|t), stored ms and the index its content starts at. Its header
-- is text (the kind, 13 digits) or, when its first byte is 128 or more, 5 bytes: a 1
-- bit, the kind bit (1: t) and the stored ms modulo 2^38, which reads back as the
-- latest such time up to a day after `now` (skmq/store/messages.py).
local WRAP = 2^38
local function read_message(m, now)
  local b1, b2, b3, b4, b5 = string.byte(m, 1, 5)
  if b1 < 128 then return string.sub(m, 1, 1), tonumber(string.sub(m, 2, 14)), 15 end
  local t = (b1 % 64) * 2^32 + b2 * 2^24 + b3 * 2^16 + b4 * 2^8 + b5
  local top = now + 86400000
  return (b1 >= 192 and 't' or 'q'), top - (top - t) % WRAP, 6
end

-- The state field of msgid's attribute (of the copy for crid, when given).
local function field(msgid, attr, crid)
  if crid then return msgid .. SEP .. attr .. SEP .. crid end
  return msgid .. SEP .. attr
end

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

-- Append to `f` the state fields of a message to drop: its own and those of its topic
-- copies. `copies`: its copies field (`c`) when the caller read it already (false:
-- none), else nil.
local function state_fields(f, state, msgid, copies)
  local p, i = msgid .. SEP, #f
  f[i + 1] = p .. 'n'; f[i + 2] = p .. 'r'; f[i + 3] = p .. 'e'; f[i + 4] = p .. 'h'
  f[i + 5] = p .. 'tp'; f[i + 6] = p .. 'o'; f[i + 7] = p .. 'dc'; f[i + 8] = p .. 'c'
  f[i + 9] = p .. 'x'; f[i + 10] = p .. 'l'; f[i + 11] = p .. 'k'; f[i + 12] = p .. 'd'
  if copies == nil then copies = redis.call('HGET', state, p .. 'c') end
  if copies then
    for rid in string.gmatch(copies, '[^\31]+') do
      f[#f + 1] = field(msgid, 'n', rid)
      f[#f + 1] = field(msgid, 'e', rid)
      f[#f + 1] = field(msgid, 'h', rid)
      f[#f + 1] = field(msgid, 'l', rid)
    end
  end
  return f
end

-- Drop a message and all its delivery state (`copies` as for state_fields).
local function forget(msgs, state, msgid, copies)
  redis.call('HDEL', state, unpack(state_fields({}, state, msgid, copies)))
  redis.call('HDEL', msgs, msgid)
end

-- One copy of a topic message is over: drop its state and count it off `counter` (o:
-- outstanding, when acked; dc: dead, when purged). True when no copy is left outstanding
-- or dead, so that the message itself can go.
local function settle_copy(state, msgid, crid, counter)
  redis.call('HDEL', state, field(msgid, 'n', crid), field(msgid, 'h', crid),
             field(msgid, 'e', crid), field(msgid, 'l', crid))
  redis.call('HINCRBY', state, field(msgid, counter), -1)
  local c = redis.call('HMGET', state, field(msgid, 'o'), field(msgid, 'dc'))
  return tonumber(c[1] or '0') <= 0 and tonumber(c[2] or '0') <= 0
end

-- The first message of an ordering key (false: none).
local function key_head(kq, key)
  return redis.call('ZRANGEBYLEX', kq, '[' .. key .. SEP, '(' .. key .. '\32', 'LIMIT', 0, 1)[1]
end

-- msgid is over (acked or dead): the next message of its ordering key, if it has one,
-- goes to the tail of `ready` (or `delayed`, when it falls due later), behind the other
-- keys' messages, so that one hot key does not starve the others. `member`: its key
-- field (`k`) when the caller read it already (false: none), else nil. Returns true if
-- it let a message go.
local function advance(state, kq, ready, delayed, msgid, now, member)
  local kf = field(msgid, 'k')
  if member == nil then member = redis.call('HGET', state, kf) end
  if not member then return end
  redis.call('HDEL', state, kf)
  redis.call('ZREM', kq, member)
  local key = string.sub(member, 1, string.find(member, SEP, 1, true) - 1)
  local nxt = key_head(kq, key)
  if not nxt then
    -- no ordered message left at all: the sequence may start again
    if redis.call('ZCARD', kq) == 0 then redis.call('HDEL', state, SEP .. 'kseq') end
    return
  end
  local id = string.sub(nxt, #key + 19)
  local due = tonumber(redis.call('HGET', state, field(id, 'd')) or '0')
  redis.call('HDEL', state, field(id, 'd'))
  if due > now then redis.call('ZADD', delayed, due, id) else redis.call('RPUSH', ready, id) end
  return true
end

-- Append one line to a delivery's history (bounded) and set its last error.
local function note(state, msgid, crid, line, err)
  local hk = field(msgid, 'h', crid)
  local h = redis.call('HGET', state, hk)
  if h then
    h = h .. '\n' .. line
    if #h > 8192 then h = string.sub(h, #h - 8191) end
  else
    h = line
  end
  redis.call('HSET', state, hk, h, field(msgid, 'e', crid), err)
end

-- When msgid expires (unix ms), or nil: it never does.
local function expiry(state, msgid)
  local x = redis.call('HGET', state, field(msgid, 'x'))
  if x then return tonumber(x) end
  return nil
end

-- An expired delivery ends now: dead-lettered with the reason `expired`, or dropped when
-- `drop` (EXPIRED=drop). A topic copy counts off its message's outstanding copies.
local function expire(msgs, state, dead, id, now, drop, line)
  local msgid, crid = split(id)
  if drop then
    if not crid or settle_copy(state, msgid, crid, 'o') then forget(msgs, state, msgid) end
    return
  end
  note(state, msgid, crid, now .. ' ' .. line, 'expired')
  redis.call('ZADD', dead, now, id)
  if crid then
    redis.call('HINCRBY', state, field(msgid, 'o'), -1)
    redis.call('HINCRBY', state, field(msgid, 'dc'), 1)
  end
end

-- A retry backoff in ARGV from index `at`: its length nb, then nb waits (ms). Returns the
-- waits, and the index of the argument after them.
local function backoff_args(at)
  local nb = tonumber(ARGV[at])
  local backoff = {}
  for j = 1, nb do backoff[j] = tonumber(ARGV[at + j]) end
  return backoff, at + 1 + nb
end

-- fn(id) for each delivery id in ARGV from index `first` on: 1 where it did (returned
-- true), 0 where its source state did not hold.
local function each_id(first, fn)
  local out = {}
  for i = first, #ARGV do
    if fn(ARGV[i]) then out[#out + 1] = 1 else out[#out + 1] = 0 end
  end
  return out
end

-- Redis's clock in microseconds, as a string (Lua's numbers would print it rounded): a
-- consumer group's generation (pull_lib.lua).
local function clock_us()
  local t = redis.call('TIME')
  return t[1] .. string.format('%06d', tonumber(t[2]))
end

-- How many entries were ever added to an app's group log `glog`: its count `gadded`
-- (kept by store.lua, each entry's `n` its own count); a log from before the count
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

-- The messages waiting (pending, delayed, waiting for a retry or behind their ordering
-- key: neither in flight nor dead), oldest stored first, for an operator (peek, purge):
-- up to `limit` (false: all) from the head of `ready`, from the first of `delayed` (by
-- due time) and from those behind their key in `kq`, stored at or before `cutoff` (false:
-- any time), the oldest `limit` of those. Reading the heads, not everything, keeps it
-- cheap on a long queue; a retry back in `ready` may then show after younger messages.
-- Each: {delivery id, r|d|k (ready, delayed, behind its key), stored ms, `msgs` value,
-- due ms (0: due now), its `kq` member (k only)}.
local function waiting(msgs, state, ready, delayed, kq, now, limit, cutoff)
  local found = {}
  local function add(id, from, due, member)
    local m = redis.call('HGET', msgs, (split(id)))
    if not m then return end
    local _, stored = read_message(m, now)
    if cutoff and stored > cutoff then return end
    found[#found + 1] = {id, from, stored, m, due, member, #found}
  end
  local stop = limit and limit - 1 or -1
  for _, id in ipairs(redis.call('LRANGE', ready, 0, stop)) do add(id, 'r', 0) end
  local d = redis.call('ZRANGE', delayed, 0, stop, 'WITHSCORES')
  for i = 1, #d, 2 do add(d[i], 'd', tonumber(d[i + 1])) end
  -- A key's first member is the one of its key in ready, delayed or in flight: skipped.
  local want, behind, start, prev = limit or math.huge, 0, 0, nil
  while behind < want do
    local page = redis.call('ZRANGE', kq, start, start + 511)
    if #page == 0 then break end
    for _, member in ipairs(page) do
      local key = string.sub(member, 1, string.find(member, SEP, 1, true) - 1)
      if key == prev and behind < want then
        local id = string.sub(member, #key + 19)
        add(id, 'k', tonumber(redis.call('HGET', state, field(id, 'd')) or '0'), member)
        behind = behind + 1
      end
      prev = key
    end
    start = start + 512
  end
  table.sort(found, function(a, b) return a[3] < b[3] or (a[3] == b[3] and a[7] < b[7]) end)
  if limit then
    for i = #found, limit + 1, -1 do found[i] = nil end
  end
  return found
end
