-- No transition: which of these msgids the app holds, for an answer that names no app.
-- KEYS: msgs
-- ARGV: msgids. Returns 1 (held) or 0 each.
local msgs = KEYS[1]
local out = {}
for i = 1, #ARGV do out[i] = redis.call('HEXISTS', msgs, ARGV[i]) end
return out
