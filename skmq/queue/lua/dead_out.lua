-- Dead letters replayed: each a new entry of its app's inbox, its owner told. The entry is
-- what the letter's value begins with (skmq/queue/dead.py): its attempts start again, its
-- TTL lifted. (A move into another app is a store there: OwnedStore.move.)
-- KEYS: dead letters (hash), by time (zset), dead topic copies by msgid (hash), inbox
-- ARGV: channel, delivery ids...
-- Returns, each: 1 replayed, 0 not a dead letter.
local dl, dz, dlt, inbox = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local out = {}
local told = false
for i = 2, #ARGV do
  local id = ARGV[i]
  local value = redis.call('HGET', dl, id)
  if not value then
    out[#out + 1] = 0
  else
    local sep = string.find(id, '\31', 1, true)
    local msgid = sep and string.sub(id, 1, sep - 1) or id
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
if told then redis.call('PUBLISH', ARGV[1], '1') end
return out
