-- Record a delivery attempt's outcome (common/store/hooks.py record).
-- KEYS: hooks due
-- ARGV: token n record outcome next_at now
-- By the lock's holder only: the record (JSON) written; outcome 'done' (delivered, given up,
-- disabled) moves the head on and makes the next delivery due now (or none); 'retry' makes this
-- one due at next_at. Returns 1, or 0 when the lock is not the token's.
local hooks, due = KEYS[1], KEYS[2]
local token, n, record, outcome, next_at, now = unpack(ARGV, 1, 6)

if redis.call('HGET', hooks, 'lock') ~= token then return 0 end
redis.call('HSET', hooks, 'd' .. n, record)
redis.call('HDEL', hooks, 'lock', 'lock_until')
if outcome == 'retry' then
  redis.call('ZADD', due, next_at, hooks)
  return 1
end
redis.call('HSET', hooks, 'head', n)
if tonumber(redis.call('HGET', hooks, 'events')) > tonumber(n) then
  redis.call('ZADD', due, now, hooks)
else
  redis.call('ZREM', due, hooks)
end
return 1
