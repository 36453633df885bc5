-- A recipient registered (again): alive from now on. Sets the app's `listed` mark (see
-- forget.lua); the store then lists the app in the apps directory. A new recipient of an
-- app that has `max` already is refused (MAX_RECIPIENTS_PER_APP).
-- An id alive at another address taken by this registration is a takeover (a second
-- consumer started with an id in use): counted in `tally` (`takeovers`), the last one
-- kept there (`takeover`: JSON {ts, id, from, to}).
-- KEYS: recipients, rstate, rbeat, listed, tally
-- ARGV: rid, registration JSON, now, max, address (host:port)
-- Returns 0 (refused), 1 (registered), or the address the id was alive at (taken over).
local before = redis.call('HGET', KEYS[1], ARGV[1])
if not before and redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[4]) then
  return 0
end
local answer = 1
if before and redis.call('HGET', KEYS[2], ARGV[1]) ~= '0' then
  local ok, rec = pcall(cjson.decode, before)
  if ok and type(rec) == 'table' and rec.host ~= nil and rec.port ~= nil then
    local was = tostring(rec.host) .. ':' .. tostring(rec.port)
    if was ~= ARGV[5] then
      answer = was
      redis.call('HINCRBY', KEYS[5], 'takeovers', 1)
      redis.call('HSET', KEYS[5], 'takeover', cjson.encode(
        {ts = tonumber(ARGV[3]), id = ARGV[1], from = was, to = ARGV[5]}))
    end
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[1], 1)
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
redis.call('SET', KEYS[4], 1)
return answer
