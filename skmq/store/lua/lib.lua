-- Shared by every message transition (prepended to each script when it is loaded).
--
-- One app's keys, all under the app's hash tag, all passed in KEYS by the caller:
--   msgs      HASH  msgid -> kind (q|t), stored ms (13 digits), then the content
--   state     HASH  delivery state, created at the first claim, one field an attribute:
--                   <msgid>\31<attr> or, for one recipient's copy of a topic message,
--                   <msgid>\31<attr>\31<rid>; attrs: n attempts, r last recipient,
--                   e last error, h history, o copies outstanding, dc copies dead,
--                   c the recipients a topic message was fanned out to (\31-joined)
--   ready     LIST  delivery ids ready to push, FIFO
--   delayed   ZSET  delivery id -> due ms (delayed messages, retry waits, replays)
--   inflight  ZSET  delivery id -> lease deadline ms (pushed, waiting for an answer)
--   dead      ZSET  delivery id -> ms it died (the dead-letter queue)
--   done:<b>  SET   msgids completed in time bucket b (dedupe after completion)
-- A delivery id is the msgid (a queue message, or a topic message not yet fanned out)
-- or <msgid>\31<rid> (one recipient's copy). No id holds \31 (a control character).

local SEP = '\31'

local function split(id)
  local p = string.find(id, SEP, 1, true)
  if p then return string.sub(id, 1, p - 1), string.sub(id, p + 1) end
  return id, nil
end

-- The state field of msgid's attribute (of the copy for crid, when given).
local function field(msgid, attr, crid)
  if crid then return msgid .. SEP .. attr .. SEP .. crid end
  return msgid .. SEP .. attr
end

-- Drop a message and all its delivery state.
local function forget(msgs, state, msgid)
  local f = {field(msgid, 'n'), field(msgid, 'r'), field(msgid, 'e'), field(msgid, 'h'),
             field(msgid, 'o'), field(msgid, 'dc'), field(msgid, 'c')}
  local copies = redis.call('HGET', state, field(msgid, 'c'))
  if copies then
    for rid in string.gmatch(copies, '[^\31]+') do
      f[#f + 1] = field(msgid, 'n', rid)
      f[#f + 1] = field(msgid, 'e', rid)
      f[#f + 1] = field(msgid, 'h', rid)
    end
  end
  redis.call('HDEL', state, unpack(f))
  redis.call('HDEL', msgs, msgid)
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
