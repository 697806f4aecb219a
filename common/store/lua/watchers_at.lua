-- A watcher set's members still counted (common/store/watchers.py watched).
-- KEYS: set
-- ARGV: grace not_before
-- not_before: a time on Redis's clock before which it is not counted ('' for none). Drops the
-- members past counting; returns {now, member, score, ...}, now being Redis's clock or
-- not_before, whichever is later.
--#include redis_now
local set = KEYS[1]
local grace, not_before = ARGV[1], ARGV[2]

local now = redis_now()
if not_before ~= '' then now = math.max(now, tonumber(not_before)) end
redis.call('ZREMRANGEBYSCORE', set, '-inf', '(' .. string.format('%.6f', now - tonumber(grace)))
local out = redis.call('ZRANGE', set, 0, -1, 'WITHSCORES')
table.insert(out, 1, string.format('%.6f', now))
return out
