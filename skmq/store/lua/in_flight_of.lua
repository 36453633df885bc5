-- No transition: the deliveries of a msgid now in flight, for an answer that did not
-- come with its push.
-- KEYS: msgs, state, inflight
-- ARGV: msgid. Returns (delivery id, recipient, attempt)*.
local msgs, state, inflight = KEYS[1], KEYS[2], KEYS[3]
local msgid = ARGV[1]
local m = redis.call('HGET', msgs, msgid)
if not m then return {} end
local out = {}
local function add(id, rid, crid)
  if redis.call('ZSCORE', inflight, id) then
    out[#out + 1] = id; out[#out + 1] = rid
    out[#out + 1] = tonumber(redis.call('HGET', state, field(msgid, 'n', crid)) or '0')
  end
end
if read_message(m, 0) == 'q' then  -- (its kind: no time is read)
  add(msgid, redis.call('HGET', state, field(msgid, 'r')) or '', nil)
  return out
end
local copies = redis.call('HGET', state, field(msgid, 'c'))
if copies then
  for rid in string.gmatch(copies, '[^\31]+') do add(msgid .. SEP .. rid, rid, rid) end
end
return out
