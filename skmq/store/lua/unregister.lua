-- A recipient gone. KEYS: recipients, rstate, rbeat. ARGV: rid. Returns 1 if it was there.
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
return redis.call('HDEL', KEYS[1], ARGV[1])
