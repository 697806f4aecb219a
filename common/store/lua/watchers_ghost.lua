-- Replace watchers by their ghosts (common/store/watchers.py ghost_watchers).
-- KEYS: set*
-- ARGV: grace ttl ghost_prefix token*
-- One token per watcher set. Each is replaced by its ghost, scored with now (Redis's clock) plus
-- the grace (s); ttl: the sets' expiry (s). Returns that end of the grace.
--#include redis_now
local grace, ttl, ghost_prefix = ARGV[1], ARGV[2], ARGV[3]

local ends = redis_now() + tonumber(grace)
for i, key in ipairs(KEYS) do
  redis.call('ZREM', key, ARGV[3 + i])
  redis.call('ZADD', key, ends, ghost_prefix .. ARGV[3 + i])
  redis.call('EXPIRE', key, ttl)
end
return string.format('%.6f', ends)
