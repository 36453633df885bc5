-- dead (in one app) -> gone there, and received -> pending as a new message of another
-- app, with the same msgid and content (`skmq dlq replay --to-app`). Anything not dead is
-- refused; so is a msgid the target app holds or finished within the dedupe window (the
-- dead letter then stays). Both apps' keys are declared; under Redis Cluster both apps
-- must hash to one slot for this script to run.
-- KEYS: msgs, state, dead (the source app); msgs, ready, listed, done:<current bucket>,
--       done:<previous bucket> (the target app, whose `listed` mark is set: the store
--       then lists it in the apps directory, as after store.lua)
-- ARGV: now (13 digits), target app, the headers of a queue and of a topic message
--       stored now (skmq/store/messages.py), then delivery ids.
-- Returns 1 (moved), 0 (not dead) or -1 (a duplicate in the target app) each.
local msgs, state, dead = KEYS[1], KEYS[2], KEYS[3]
local to_msgs, to_ready, to_listed, cur, prev = KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local now = tonumber(ARGV[1])
local headers = {q = ARGV[3], t = ARGV[4]}
local out = {}
for i = 5, #ARGV do
  local id = ARGV[i]
  local msgid, crid = split(id)
  local m = redis.call('HGET', msgs, msgid)
  local kind, _, start
  if m then kind, _, start = read_message(m, now) end
  if not redis.call('ZSCORE', dead, id) or not m then
    out[#out + 1] = 0
  elseif redis.call('SISMEMBER', cur, msgid) == 1 or redis.call('SISMEMBER', prev, msgid) == 1
      or redis.call('HSETNX', to_msgs, msgid, headers[kind] .. string.sub(m, start)) == 0 then
    out[#out + 1] = -1
  else
    redis.call('RPUSH', to_ready, msgid)
    redis.call('SET', to_listed, 1)
    redis.call('ZREM', dead, id)
    if not crid or settle_copy(state, msgid, crid, 'dc') then forget(msgs, state, msgid) end
    out[#out + 1] = 1
  end
end
return out
