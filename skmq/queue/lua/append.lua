-- A store on a broker that does not own the app's queue: the messages appended to the
-- inbox (unless settled within the dedupe window or held as a dead letter of the app:
-- lib.lua), and the owner told. The owner drops a duplicate of a message it holds when
-- it reads the entry (a live msgid is known only to it). The inbox is apart from the
-- owner's log so that the owner, the log's only writer, knows every entry of it without
-- reading it back.
-- The app's `listed` mark is set; when it is new, or no broker owns the app, the caller
-- lists the app in the apps directory (skmq/store/directory.py) before it answers: the
-- ownership rounds read the directory, and a broker that died between a first store's
-- write and its listing left an app there unlisted, which a store sent again lists.
-- The app's consumer groups are fed as feed.lua (prepended) says.
-- A dead letter moved into an app no broker owns is appended so too (OwnedStore.move),
-- the app's epoch key after the rest, the epoch its mover read and the last
-- inbox entry it read after the channel: the mover read the app's stored state as a new
-- owner would and left out the msgids live there (only an owner knows them: a live
-- one's entry is dropped as its duplicate when read). Where the app is owned now the
-- script answers {'owned'} (its owner's to store); where another epoch began since the
-- mover read it, {'changed'} (read it again); else what the inbox took since is all
-- that changed: a msgid there is a duplicate.
-- KEYS: inbox, done:<current bucket>, done:<previous bucket>, listed,
--       groups, recipients, glog, gseen, gadded, dead letters (hash), dead topic copies
--       by msgid (hash), owner(, epoch: a move)
-- ARGV: channel(, epoch, inbox entry: a move), (msgid, content, header ('': none))*
-- Returns {inbox entry id, '-' for the groups alone, or 0 for a duplicate}*, then 1 if
-- the app is to be listed (its `listed` mark new, or no owner) else 0.
local first = 2  -- the first message's ARGV
local present = {}  -- msgids taken (a second one in the batch is its duplicate)
local owned = redis.call('EXISTS', KEYS[12]) == 1
if KEYS[13] then
  if owned then return {'owned'} end
  if (redis.call('GET', KEYS[13]) or '0') ~= ARGV[2] then return {'changed'} end
  for _, e in ipairs(redis.call('XRANGE', KEYS[1], '(' .. ARGV[3], '+')) do
    if e[2][1] == 'm' then present[e[2][2]] = true end
  end
  first = 4
end
local log, cur, prev = KEYS[1], KEYS[2], KEYS[3]
local ids = {}
for i = first, #ARGV, 3 do ids[#ids + 1] = ARGV[i] end
local e = ended_of(cur, prev, KEYS[10], KEYS[11], ids)
local g = groups_of(KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], ids)
local out = {}
local told = false
for j = 1, #ids do
  local i = first + 3 * (j - 1)
  if ended(e, j) or (g and g.seen[j]) or present[ARGV[i]] then
    out[j] = 0
  else
    present[ARGV[i]] = true
    if g then feed(g, ARGV[i], ARGV[i + 1], ARGV[i + 2]) end
    if g and g.pull_only then
      out[j] = '-'
    else
      told = true
      if ARGV[i + 2] == '' then
        out[j] = redis.call('XADD', log, '*', 'm', ARGV[i], 'c', ARGV[i + 1])
      else
        out[j] = redis.call('XADD', log, '*', 'm', ARGV[i], 'c', ARGV[i + 1], 'h', ARGV[i + 2])
      end
    end
  end
end
fed(g, '1')
if told then redis.call('PUBLISH', ARGV[1], '1') end
local new = redis.call('SET', KEYS[4], 1, 'NX')
out[#out + 1] = (new or not owned) and 1 or 0
return out
