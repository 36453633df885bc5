-- The owner's checkpoint, fenced by its epoch: its state as of a journal entry, then
-- the journal up to that entry, and the log and the inbox below the oldest entry of each
-- still needed, dropped.
-- KEYS: epoch, checkpoint, journal, log, inbox
-- ARGV: epoch, state, journal entry id it covers, the oldest log entry id still needed
--       (with nothing materialised, the one after the cursor), the same of the inbox
-- Returns 1, or {'fenced', current epoch}.
local epoch = redis.call('GET', KEYS[1])
if epoch ~= ARGV[1] then return {'fenced', epoch or '0'} end
redis.call('SET', KEYS[2], ARGV[2])
redis.call('XTRIM', KEYS[3], 'MINID', ARGV[3])
redis.call('XDEL', KEYS[3], ARGV[3])
redis.call('XTRIM', KEYS[4], 'MINID', ARGV[4])
redis.call('XTRIM', KEYS[5], 'MINID', ARGV[5])
return 1
