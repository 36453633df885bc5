-- The owner's write of one loop turn, fenced by its epoch: the messages it stored
-- (each appended to the log, unless its msgid was settled within the dedupe window or is
-- held as a dead letter of the app: lib.lua),
-- the journal's records since the last flush (one entry, with the epoch that wrote it),
-- the deliveries dead since
-- (to the app's dead letters, their content copied from their log or inbox entry:
-- skmq/queue/dead.py), and the msgids settled (to the dedupe window's bucket). An owner
-- whose epoch is not the current one writes nothing: it was taken over.
-- A flush that logs messages sets the app's `listed` mark; when the mark is new, the
-- caller lists the app in the apps directory (skmq/store/directory.py: its set is in
-- another slot of a cluster) before it answers.
-- The app's consumer groups are fed as feed.lua (prepended) says: a message for the
-- groups alone is answered '-' (stored, with no log entry).
-- KEYS: epoch, log, journal, done:<current bucket>, done:<previous bucket>, inbox,
--       dead letters (hash), dead letters by time (zset), listed,
--       groups, recipients, glog, gseen, gadded, dead topic copies by msgid (hash)
-- Entries appended to the inbox after the owner's inbox cursor are returned first, read
-- before the messages are logged: a message acked through another broker before this
-- store came is materialised before it (per-key order over brokers). Those of a msgid
-- that has ended are marked (lib.lua: mark_seen).
-- ARGV: epoch, done ttl ms, inbox cursor ('': not read), message count m,
--       (msgid, content, header ('': none))*m,
--       records ('': none), dead count d, (delivery id, died ms, value head, entry,
--       in inbox '1'|'0')*d, settled msgid*
-- Returns {'fenced', current epoch} or {inbox entries (XRANGE's reply),
-- (log entry id, '-' for the groups alone, or 0 for a duplicate)*m, the journal entry
-- written ('' : none), 1 if the `listed` mark is new else 0}.
local epoch = redis.call('GET', KEYS[1])
if epoch ~= ARGV[1] then return {'fenced', epoch or '0'} end
local log, journal, cur, prev = KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local m = tonumber(ARGV[4])
local out = {{}}
if ARGV[3] ~= '' then
  out[1] = redis.call('XRANGE', KEYS[6], '(' .. ARGV[3], '+', 'COUNT', 512)
  mark_seen(out[1], cur, prev, KEYS[7], KEYS[15])
end
if m > 0 then
  local ids = {}
  for j = 1, m do ids[j] = ARGV[2 + 3 * j] end
  local e = ended_of(cur, prev, KEYS[7], KEYS[15], ids)
  local g = groups_of(KEYS[10], KEYS[11], KEYS[12], KEYS[13], KEYS[14], ids)
  for j = 1, m do
    local i = 2 + 3 * j
    if ended(e, j) or (g and g.seen[j]) then
      out[j + 1] = 0
    else
      if g then feed(g, ARGV[i], ARGV[i + 1], ARGV[i + 2]) end
      if g and g.pull_only then
        out[j + 1] = '-'
      elseif ARGV[i + 2] == '' then
        out[j + 1] = redis.call('XADD', log, '*', 'm', ARGV[i], 'c', ARGV[i + 1])
      else
        out[j + 1] = redis.call('XADD', log, '*', 'm', ARGV[i], 'c', ARGV[i + 1], 'h', ARGV[i + 2])
      end
    end
  end
  fed(g, ARGV[1])
end
local r = 5 + 3 * m
local journaled = ''
if ARGV[r] ~= '' then journaled = redis.call('XADD', journal, '*', 'r', ARGV[r], 'e', ARGV[1]) end
local d = tonumber(ARGV[r + 1])
for j = 0, d - 1 do
  local i = r + 2 + 5 * j
  local stream = ARGV[i + 4] == '1' and KEYS[6] or log
  local found = redis.call('XRANGE', stream, ARGV[i + 3], ARGV[i + 3])
  local content = ''
  if found[1] then
    local fields = found[1][2]
    for k = 1, #fields, 2 do
      if fields[k] == 'c' then content = fields[k + 1] end
    end
  end
  if redis.call('HSET', KEYS[7], ARGV[i], ARGV[i + 2] .. content) == 1 then
    count_dead(KEYS[15], ARGV[i], 1)
  end
  redis.call('ZADD', KEYS[8], ARGV[i + 1], ARGV[i])
end
local s = r + 2 + 5 * d
local new_mark = 0
if m > 0 and redis.call('SET', KEYS[9], 1, 'NX') then new_mark = 1 end
if #ARGV >= s then
  redis.call('SADD', cur, unpack(ARGV, s))
  redis.call('PEXPIRE', cur, ARGV[2])
end
out[#out + 1] = journaled
out[#out + 1] = new_mark
return out
