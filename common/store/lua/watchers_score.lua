-- Score watchers with the end of their lease (common/store/watchers.py).
-- KEYS: set*
-- ARGV: seconds ttl mode token*
-- One token per watcher set. Each is scored with now (Redis's clock) plus seconds; ttl: the
-- sets' expiry (s); mode: 'XX' for a renewal (only the tokens still there) or ''.
--#include redis_now
local seconds, ttl, mode = ARGV[1], ARGV[2], ARGV[3]

local deadline = redis_now() + tonumber(seconds)
for i, key in ipairs(KEYS) do
  if mode == 'XX' then
    redis.call('ZADD', key, 'XX', deadline, ARGV[3 + i])
  else
    redis.call('ZADD', key, deadline, ARGV[3 + i])
  end
  redis.call('EXPIRE', key, ttl)
end
