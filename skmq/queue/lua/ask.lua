-- A recipient's answer reached a broker that does not own the app: appended to the app's
-- inbox as a question (skmq/queue/forward.py), and the owner told.
-- KEYS: inbox
-- ARGV: channel, question
redis.call('XADD', KEYS[1], '*', 'q', ARGV[2])
redis.call('PUBLISH', ARGV[1], '1')
return 1
