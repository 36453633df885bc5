-- The owner's read of its inbox: up to ARGV[2] entries after ARGV[1] (XRANGE's reply),
-- those of a msgid that has ended marked (lib.lua: mark_seen).
-- KEYS: inbox, done:<current bucket>, done:<previous bucket>, dead letters (hash),
--       dead topic copies by msgid (hash)
-- ARGV: the first id ('(' exclusive, as XRANGE's), count
local entries = redis.call('XRANGE', KEYS[1], ARGV[1], '+', 'COUNT', ARGV[2])
mark_seen(entries, KEYS[2], KEYS[3], KEYS[4], KEYS[5])
return entries
