-- Fail a batch the feeder cannot advance (common/store/batches.py fail_batch).
-- KEYS: batch active window results
-- ARGV: id now ttl errors
-- errors: the reason (JSON). A batch that an unexpected error stops tick after tick fails with
-- the reason, so it stops taking the feeder's time. Returns the status it had.
--#include hook_event
local batch, active, window, results = unpack(KEYS)
local id, now, ttl, errors = unpack(ARGV, 1, 4)

local status = redis.call('HGET', batch, 'status')
if not status or status == 'completed' or status == 'failed' or status == 'expired'
   or status == 'cancelled' then
  redis.call('SREM', active, id)
  return status or 'missing'
end
redis.call('HSET', batch, 'status', 'failed', 'failed_at', now, 'errors', errors)
redis.call('SREM', active, id)
for _, key in ipairs({batch, window, results}) do redis.call('EXPIRE', key, ttl) end
hook_event(batch, 'failed', 'batch.failed', now)
return status
