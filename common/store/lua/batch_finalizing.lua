-- Every line of a batch has its result: in_progress -> finalizing (common/store/batches.py).
-- KEYS: batch
-- ARGV: now
-- Returns 1, or 0 when the batch is not in_progress or is ending.
local batch = KEYS[1]
local now = ARGV[1]

if redis.call('HGET', batch, 'status') ~= 'in_progress' or redis.call('HGET', batch, 'ending') then
  return 0
end
redis.call('HSET', batch, 'status', 'finalizing', 'finalizing_at', now)
return 1
