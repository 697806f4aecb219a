-- Take a hooks hash's lock for its next delivery (common/store/hooks.py begin).
-- KEYS: hooks due
-- ARGV: token now claim
-- The lock is taken when free, or when its holder's claim (s) ended. Returns {n, record, body
-- ('' until rendered), hook} or false (locked, or nothing left: out of the due set).
local hooks, due = KEYS[1], KEYS[2]
local token, now, claim = ARGV[1], ARGV[2], ARGV[3]

if redis.call('EXISTS', hooks) == 0 then
  redis.call('ZREM', due, hooks)
  return false
end
local lock, until_ = unpack(redis.call('HMGET', hooks, 'lock', 'lock_until'))
if lock and tonumber(until_) > tonumber(now) then return false end
local n = tonumber(redis.call('HGET', hooks, 'head') or '0') + 1
if n > tonumber(redis.call('HGET', hooks, 'events') or '0') then
  redis.call('ZREM', due, hooks)
  return false
end
local ends = tonumber(now) + tonumber(claim)
redis.call('HSET', hooks, 'lock', token, 'lock_until', ends)
redis.call('ZADD', due, ends, hooks)
local record, body, hook = unpack(redis.call('HMGET', hooks, 'd' .. n, 'b' .. n, 'hook'))
return {n, record, body or '', hook}
