-- The owner's write of one loop turn, fenced by its epoch: the messages it stored
-- (each appended to the log, unless its msgid was settled within the dedupe window),
-- the journal's records since the last flush (one entry), and the msgids settled (to
-- the dedupe window's bucket). An owner whose epoch is not the current one writes
-- nothing: it was taken over.
-- KEYS: epoch, log, journal, done:<current bucket>, done:<previous bucket>
-- ARGV: epoch, done ttl ms, message count m, (msgid, content, header ('': none))*m,
--       records ('': none), settled msgid*
-- Returns {'fenced', current epoch} or {log entry id, or 0 for a duplicate}*m.
local epoch = redis.call('GET', KEYS[1])
if epoch ~= ARGV[1] then return {'fenced', epoch or '0'} end
local log, journal, cur, prev = KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local m = tonumber(ARGV[3])
local out = {}
if m > 0 then
  local ids = {}
  for j = 1, m do ids[j] = ARGV[1 + 3 * j] end
  local in_cur = redis.call('SMISMEMBER', cur, unpack(ids))
  local in_prev = redis.call('SMISMEMBER', prev, unpack(ids))
  for j = 1, m do
    local i = 1 + 3 * j
    if in_cur[j] == 1 or in_prev[j] == 1 then
      out[j] = 0
    elseif ARGV[i + 2] == '' then
      out[j] = redis.call('XADD', log, '*', 'm', ARGV[i], 'c', ARGV[i + 1])
    else
      out[j] = redis.call('XADD', log, '*', 'm', ARGV[i], 'c', ARGV[i + 1], 'h', ARGV[i + 2])
    end
  end
end
local r = 4 + 3 * m
if ARGV[r] ~= '' then redis.call('XADD', journal, '*', 'r', ARGV[r]) end
if #ARGV > r then
  redis.call('SADD', cur, unpack(ARGV, r + 1))
  redis.call('PEXPIRE', cur, ARGV[2])
end
return out
