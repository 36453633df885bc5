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
