-- Shared by the owner engine's scripts: each script carries the helpers it uses
-- (skmq/queue/journal.py prepends them, as skmq/store/scripts.py does the store's).
--
-- An app's dead letters (skmq/queue/dead.py), under its hash tag, passed in KEYS:
--   dl   HASH  delivery id -> the letter: the msgid (a queue message) or
--              <msgid>\31<recipient> (one recipient's copy of a topic message)
--   dlt  HASH  msgid -> how many copies of that topic message `dl` holds
-- A msgid held as a dead letter is a duplicate of any store or move into the app, as a
-- stored message is (ENGINE=scripts keeps a dead one in `msgs`): `dlt` answers for a
-- topic message's copies in the same one call a batch as `dl` does for queue messages.

-- Whether the app holds each msgid of `ids` as a dead letter: true or false each.
local function dead_held(dl, dlt, ids)
  local queued = redis.call('HMGET', dl, unpack(ids))
  local copied = redis.call('HMGET', dlt, unpack(ids))
  local out = {}
  for j = 1, #ids do out[j] = queued[j] ~= false or copied[j] ~= false end
  return out
end

-- A dead letter `id` added (by 1) or gone (by -1): a topic copy's msgid counted in `dlt`.
local function count_dead(dlt, id, by)
  local sep = string.find(id, '\31', 1, true)
  if not sep then return end
  local msgid = string.sub(id, 1, sep - 1)
  if redis.call('HINCRBY', dlt, msgid, by) <= 0 then redis.call('HDEL', dlt, msgid) end
end
