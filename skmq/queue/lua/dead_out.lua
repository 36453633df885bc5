-- Dead letters out of an app's dead letters, each a new entry of an app's inbox (the
-- same app: a replay; another: a move), its owner told. The entry is what the letter's
-- value begins with (skmq/queue/dead.py): a replay's attempts start again, its TTL lifted.
-- A move is refused where the target app settled the msgid within its dedupe window or
-- holds it as a dead letter (lib.lua): a duplicate there.
-- KEYS: the source's dead letters (hash), by time (zset), dead topic copies by msgid
--       (hash); the target's inbox, done:<current bucket>, done:<previous bucket>, dead
--       letters (hash), dead topic copies by msgid (hash)
-- ARGV: channel, check the target for duplicates '1'|'0' (a move), delivery ids...
-- Returns, each: 1 out, 0 not a dead letter, -1 a duplicate in the target.
local dl, dz, dlt, inbox = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local out = {}
local told = false
for i = 3, #ARGV do
  local id = ARGV[i]
  local value = redis.call('HGET', dl, id)
  if not value then
    out[#out + 1] = 0
  else
    local sep = string.find(id, '\31', 1, true)
    local msgid = sep and string.sub(id, 1, sep - 1) or id
    if ARGV[2] == '1'
        and ended(ended_of(KEYS[5], KEYS[6], KEYS[7], KEYS[8], {msgid}), 1) then
      out[#out + 1] = -1
    else
      local a = string.find(value, '\n', 1, true)
      local b = string.find(value, '\n', a + 1, true)
      local header, content = string.sub(value, 1, a - 1), string.sub(value, b + 1)
      if header == '' then
        redis.call('XADD', inbox, '*', 'm', msgid, 'c', content)
      else
        redis.call('XADD', inbox, '*', 'm', msgid, 'c', content, 'h', header)
      end
      redis.call('HDEL', dl, id)
      redis.call('ZREM', dz, id)
      count_dead(dlt, id, -1)
      told = true
      out[#out + 1] = 1
    end
  end
end
if told then redis.call('PUBLISH', ARGV[1], '1') end
return out
