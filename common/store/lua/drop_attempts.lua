-- Drop the attempts fields of the jobs that no longer run (common/store/sync.py).
-- KEYS: attempts job*
-- ARGV: id*
-- One id per job hash, in the same order. A job no longer runs when its hash went while it ran
-- (lost, deleted, or expired) or it ended without its last append dropping the field. A field
-- is written only with `running` (take.lua) and a job never runs again once ended, so a job
-- read here as not running has no use for it: its hash's attempt fences it.
-- Returns how many fields it dropped.
local attempts = KEYS[1]

local dropped = 0
for i = 2, #KEYS do
  if redis.call('HGET', KEYS[i], 'status') ~= 'running' then
    dropped = dropped + redis.call('HDEL', attempts, ARGV[i - 1])
  end
end
return dropped
