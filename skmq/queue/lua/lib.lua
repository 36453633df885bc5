-- Shared by the owner engine's scripts: each script carries the helpers it uses
-- (skmq/queue/journal.py prepends them, as skmq/store/scripts.py does the store's).
--
-- An app's dead letters (skmq/queue/dead.py), under its hash tag, passed in KEYS:
--   dl   HASH  delivery id -> the letter: the msgid (a queue message) or
--              <msgid>\31<recipient> (one recipient's copy of a topic message)
--   dlt  HASH  msgid -> how many copies of that topic message `dl` holds
-- A msgid held as a dead letter is a duplicate of any store or move into the app, as a
-- stored message is (ENGINE=scripts keeps a dead one in `msgs`): one HMGET a batch of
-- `dl` finds a queue message's letter, one of `dlt` a topic message's copies.

-- The app's dead letters of each msgid of `ids`, as two HMGET replies: `dl`'s (a queue
-- message's letter) and `dlt`'s (a topic message's copies). A msgid is held as a dead
-- letter where either is not false. (The replies as they are: a table of booleans
-- built from them costs a batch of 64 as much again as one HMGET.)
local function dead_of(dl, dlt, ids)
  return redis.call('HMGET', dl, unpack(ids)), redis.call('HMGET', dlt, unpack(ids))
end

-- A dead letter `id` added (by 1) or gone (by -1): a topic copy's msgid counted in `dlt`.
local function count_dead(dlt, id, by)
  local sep = string.find(id, '\31', 1, true)
  if not sep then return end
  local msgid = string.sub(id, 1, sep - 1)
  if redis.call('HINCRBY', dlt, msgid, by) <= 0 then redis.call('HDEL', dlt, msgid) end
end

-- Marks (a field `seen` added to the reply, not to the stream) each entry of `entries`
-- (an inbox's XRANGE reply) whose msgid is settled within the dedupe window (`cur`,
-- `prev`) or held as a dead letter (`dl`, `dlt`). A store through another broker of a
-- msgid live at the owner is appended to the inbox (only the owner knows its live
-- msgids): read after that message ended, the entry is its duplicate, which the owner
-- drops (ENGINE=scripts answers it so). Forwarded answers (no msgid) are left alone.
local function mark_seen(entries, cur, prev, dl, dlt)
  local ids, at = {}, {}
  for k, e in ipairs(entries) do
    if e[2][1] == 'm' then
      ids[#ids + 1] = e[2][2]
      at[#ids] = k
    end
  end
  if #ids == 0 then return end
  local in_cur = redis.call('SMISMEMBER', cur, unpack(ids))
  local in_prev = redis.call('SMISMEMBER', prev, unpack(ids))
  local dead_q, dead_t = dead_of(dl, dlt, ids)
  for j = 1, #ids do
    if in_cur[j] == 1 or in_prev[j] == 1 or dead_q[j] or dead_t[j] then
      local fields = entries[at[j]][2]
      fields[#fields + 1] = 'seen'
      fields[#fields + 1] = '1'
    end
  end
end
