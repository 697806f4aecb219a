-- Take or renew the batch feeder's lease (common/store/batches.py claim_feeder).
-- KEYS: feeder counter
-- ARGV: token lease_ms
-- feeder: the lease key, holding ``token:fence``; counter: the fence counter; token: this process's.
-- The fence goes up by one each time another feeder (or the same one after it lost the lease)
-- takes the lease. A batch's result file is written into a list of its own fence
-- (Keys.file_attempt); every append (file_append_attempt.lua) and the commit (file_commit.lua)
-- check that the lease still holds that value, and the commit checks the line count too: a
-- feeder frozen mid-file and taken over can write nothing after it wakes, and a file is
-- committed whole or not at all.
-- Returns the fence the lease is held with, or 0 when another process holds it.
local feeder, counter = KEYS[1], KEYS[2]
local token, lease_ms = ARGV[1], ARGV[2]

local holder = redis.call('GET', feeder)
if holder then
  local held_by, fence = string.match(holder, '^(.*):(%d+)$')
  if held_by ~= token then return 0 end
  redis.call('PEXPIRE', feeder, lease_ms)
  return tonumber(fence)
end
local fence = redis.call('INCR', counter)
redis.call('SET', feeder, token .. ':' .. fence, 'PX', lease_ms)
return fence
