-- Shared by the owner engine's scripts: each script carries the helpers it uses
-- (skmq/queue/journal.py prepends them, as skmq/store/scripts.py does the store's).
--
-- An app's dead letters (skmq/queue/dead.py), under its hash tag, passed in KEYS:
--   dl   HASH  delivery id -> the letter: the msgid (a queue message) or
--              <msgid>\31<recipient> (one recipient's copy of a topic message)
--   dlt  HASH  msgid -> how many copies of that topic message `dl` holds
-- A msgid held as a dead letter is a duplicate of any store or move into the app, as a
-- stored message is: one HMGET a batch of
-- `dl` finds a queue message's letter, one of `dlt` a topic message's copies.

-- Which msgids of `ids` a store, a move or an inbox entry must not bring back: those
-- settled within the dedupe window (`cur`, `prev`: SMISMEMBER) or held as a dead letter
-- (`dl`: a queue message's letter, `dlt`: a topic message's copies; HMGET). The four
-- replies as they are, `ended(e, j)` reading the j-th msgid's (a table of booleans built
-- from them costs a batch of 64 as much again as one HMGET).
local function ended_of(cur, prev, dl, dlt, ids)
  return {redis.call('SMISMEMBER', cur, unpack(ids)),
          redis.call('SMISMEMBER', prev, unpack(ids)),
          redis.call('HMGET', dl, unpack(ids)),
          redis.call('HMGET', dlt, unpack(ids))}
end
local function ended(e, j)
  return e[1][j] == 1 or e[2][j] == 1 or e[3][j] or e[4][j]
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
-- drops. Forwarded answers (no msgid) are left alone.
local function mark_seen(entries, cur, prev, dl, dlt)
  local ids, at = {}, {}
  for k, e in ipairs(entries) do
    if e[2][1] == 'm' then
      ids[#ids + 1] = e[2][2]
      at[#ids] = k
    end
  end
  if #ids == 0 then return end
  local e = ended_of(cur, prev, dl, dlt, ids)
  for j = 1, #ids do
    if ended(e, j) then
      local fields = entries[at[j]][2]
      fields[#fields + 1] = 'seen'
      fields[#fields + 1] = '1'
    end
  end
end
