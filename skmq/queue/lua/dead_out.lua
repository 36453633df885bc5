-- Dead letters out of an app's dead letters, each a new entry of an app's inbox (the
-- same app: a replay; another: a move), its owner told. The entry is what the letter's
-- value begins with (skmq/queue/dead.py): a replay's attempts start again, its TTL lifted.
-- KEYS: dead letters (hash), by time (zset), the target's inbox, the target's
--       done:<current bucket>, done:<previous bucket>
-- ARGV: channel, check the target's dedupe window '1'|'0' (a move: a msgid settled there
--       is a duplicate), delivery ids...
-- Returns, each: 1 out, 0 not a dead letter, -1 a duplicate in the target.
local dl, dz, inbox = KEYS[1], KEYS[2], KEYS[3]
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
    if ARGV[2] == '1' and (redis.call('SISMEMBER', KEYS[4], msgid) == 1
        or redis.call('SISMEMBER', KEYS[5], msgid) == 1) then
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
      told = true
      out[#out + 1] = 1
    end
  end
end
if told then redis.call('PUBLISH', ARGV[1], '1') end
return out
