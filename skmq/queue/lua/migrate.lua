-- Messages of a store an earlier SKMQ wrote (the per-transition scripts: skmq/queue/
-- migrate.py) moved into the owner engine's layout, a message at a time: each one still
-- in the old `msgs` hash is taken out of it, its live deliveries appended to the inbox
-- (the app's next owner reads them as stores), its dead ones made dead letters. One
-- already gone from `msgs` (moved by another broker's migration) is skipped, so that
-- brokers starting together move each message once.
-- The inbox entries keep the ms the messages were stored at, as far as the stream
-- allows (an entry id never goes below the last one).
-- KEYS: msgs, inbox, dead letters (hash), by time (zset), dead topic copies by msgid
-- ARGV: channel, then per message: its msgid as `msgs` holds it, live count, dead count,
--       (stored ms, msgid, content, header ('': none))*live,
--       (delivery id as the old `dead` holds it, delivery id, died ms, value)*dead
-- Returns how many messages it moved.
local msgs, inbox, dl, dz, dlt = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local last = redis.call('XREVRANGE', inbox, '+', '-', 'COUNT', 1)[1]
local last_ms = last and string.match(last[1], '^%d+') or '0'
local moved, told = 0, false
local i = 2
while i <= #ARGV do
  local live, dead = tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  local here = redis.call('HDEL', msgs, ARGV[i]) == 1
  i = i + 3
  if here then moved = moved + 1 end
  for _ = 1, live do
    if here then
      if tonumber(ARGV[i]) > tonumber(last_ms) then last_ms = ARGV[i] end
      local id = last_ms .. '-*'
      if ARGV[i + 3] == '' then
        redis.call('XADD', inbox, id, 'm', ARGV[i + 1], 'c', ARGV[i + 2])
      else
        redis.call('XADD', inbox, id, 'm', ARGV[i + 1], 'c', ARGV[i + 2], 'h', ARGV[i + 3])
      end
      told = true
    end
    i = i + 4
  end
  for _ = 1, dead do
    if here then
      redis.call('ZREM', dz, ARGV[i])
      redis.call('ZADD', dz, ARGV[i + 2], ARGV[i + 1])
      redis.call('HSET', dl, ARGV[i + 1], ARGV[i + 3])
      count_dead(dlt, ARGV[i + 1], 1)
    end
    i = i + 4
  end
end
if told then redis.call('PUBLISH', ARGV[1], '1') end
return moved
