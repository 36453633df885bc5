-- Give the queue up (a broker stopping): the lease goes, the epoch stays, so the next
-- owner increments it and our writes are refused from then on.
-- KEYS: owner
-- ARGV: "<broker>:<epoch>"
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
