-- Forget an app that holds nothing: no recipient, no consumer group, no
-- message in its log or inbox (its owner's checkpoint trims them as deliveries end), no
-- dead letter. Its leftovers and its `listed` mark go in one step; the store then takes
-- it out of the apps directory and lists it again if a store or a registration set the
-- mark meanwhile (skmq/store/directory.py). Its epoch stays: a stale owner stays fenced.
-- KEYS: log, inbox, dead, recipients, groups, then the keys dropped: checkpoint, journal,
--       stats, owner, rstate, rbeat, rate, listed, tally, dead topic copies by msgid (none
--       is left with no dead letter: lib.lua; dropped all the same)
-- Returns 1 if forgotten.
if redis.call('XLEN', KEYS[1]) > 0 or redis.call('XLEN', KEYS[2]) > 0
    or redis.call('ZCARD', KEYS[3]) > 0 or redis.call('HLEN', KEYS[4]) > 0
    or redis.call('HLEN', KEYS[5]) > 0 then
  return 0
end
redis.call('DEL', unpack(KEYS, 6))
return 1
