-- in flight (attempt n) -> waiting retry | dead: a recipient's reject or error, a broken
-- connection, an unreachable recipient's topic copy.
-- KEYS, ARGV: as retry.lua, then (delivery id, outcome, detail, rid, attempt)*
-- Returns (code, attempt, due, rid)*.
local out = {}
for i = rest, #ARGV, 5 do
  local r = fail_one(ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], tonumber(ARGV[i + 4]))
  for _, v in ipairs(r) do out[#out + 1] = v end
end
return out
