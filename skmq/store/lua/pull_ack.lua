-- in flight (attempt n, lease running) -> acked, for one consumer group. A receipt of an
-- earlier attempt, or whose lease ran out, is refused: it never settles a redelivery.
-- KEYS, ARGV: as pull_lib.lua, then receipts (entry id, n, generation)*. Returns, for
-- each, the attempt it acked (since the entry's last replay), or 0 (refused).
-- The batch's reads (leases, attempts, ordering keys) and writes are one call each, not
-- one a receipt: a batch of 100 costs Redis a tenth of the calls. A plain group (no
-- entry with an e, t or b field: pull_lib.lua) has only the entries' n to read and
-- delete, and one with no ordering key waiting (`kq` empty) no ordering key to release.
local ids, nfields = {}, {}
for i = rest, #ARGV, 3 do
  local id = ARGV[i]
  ids[#ids + 1] = id
  nfields[#nfields + 1] = nfield(id)
end
if #ids == 0 then return {} end
local plain = redis.call('HEXISTS', gstate, PLAIN) == 1
local leases = call_all('ZMSCORE', inflight, ids)
local ns = call_all('HMGET', gstate, nfields)
local bs = {}
if not plain then
  local bfields = {}
  for j, id in ipairs(ids) do bfields[j] = bfield(id) end
  bs = call_all('HMGET', gstate, bfields)
end
local g = generation()
local out, acked, gone, seen = {}, {}, {}, {}
for j, id in ipairs(ids) do
  local i = rest + (j - 1) * 3
  local n = tonumber(ARGV[i + 1])
  out[j] = 0
  if not seen[id] and leases[j] and tonumber(leases[j]) >= now
      and tonumber(ns[j] or '0') == n and ARGV[i + 2] == g then
    seen[id] = true  -- (the same receipt twice in a batch: the second is refused)
    out[j] = n - tonumber(bs[j] or '0')
    acked[#acked + 1] = id
    gone[#gone + 1] = nfields[j]
    if not plain then
      gone[#gone + 1] = efield(id); gone[#gone + 1] = tfield(id); gone[#gone + 1] = bfield(id)
    end
  end
end
if #acked > 0 then
  call_all('ZREM', inflight, acked)
  call_all('ZREM', held, acked)
  call_all('HDEL', gstate, gone)
  if redis.call('EXISTS', gkq) == 1 then
    local ofields = {}
    for j, id in ipairs(acked) do ofields[j] = ofield(id) end
    local keyed = call_all('HMGET', gstate, ofields)
    for j, id in ipairs(acked) do
      if keyed[j] then release(id) end  -- (the next entry of its ordering key may go)
    end
  end
end
return out
