-- A store on a broker that does not own the app's queue: the messages appended to the
-- inbox (unless settled within the dedupe window), and the owner told. The owner drops
-- a duplicate of a message it holds when it reads the entry (a live msgid is known only
-- to it). The inbox is apart from the owner's log so that the owner, the log's only
-- writer, knows every entry of it without reading it back.
-- The app's `listed` mark is set, and the app listed in the apps directory when the mark
-- is new (skmq/store/directory.py).
-- KEYS: inbox, done:<current bucket>, done:<previous bucket>, listed, the directory's set
-- ARGV: channel, app id, (msgid, content, header ('': none))*
-- Returns {log entry id, or 0 for a duplicate}*.
local log, cur, prev = KEYS[1], KEYS[2], KEYS[3]
local ids = {}
for i = 3, #ARGV, 3 do ids[#ids + 1] = ARGV[i] end
local in_cur = redis.call('SMISMEMBER', cur, unpack(ids))
local in_prev = redis.call('SMISMEMBER', prev, unpack(ids))
local out = {}
for j = 1, #ids do
  local i = 3 * j
  if in_cur[j] == 1 or in_prev[j] == 1 then
    out[j] = 0
  elseif ARGV[i + 2] == '' then
    out[j] = redis.call('XADD', log, '*', 'm', ARGV[i], 'c', ARGV[i + 1])
  else
    out[j] = redis.call('XADD', log, '*', 'm', ARGV[i], 'c', ARGV[i + 1], 'h', ARGV[i + 2])
  end
end
if redis.call('SET', KEYS[4], 1, 'NX') then redis.call('SADD', KEYS[5], ARGV[2]) end
redis.call('PUBLISH', ARGV[1], '1')
return out
