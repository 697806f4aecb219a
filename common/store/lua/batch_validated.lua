-- The end of a batch's validation (common/store/batches.py validated).
-- KEYS: batch active
-- ARGV: id outcome now line_count total errors
-- active: the set of batches not ended; outcome: 'ok' or 'failed'; errors: the lines' errors (JSON).
-- in_progress with its counts, or failed with the lines' errors. A batch cancelled while it was
-- validated stays cancelling (with its counts, if valid). Returns the batch's status.
--#include hook_event
local batch, active = KEYS[1], KEYS[2]
local id, outcome, now, line_count, total, errors = unpack(ARGV, 1, 6)

local status = redis.call('HGET', batch, 'status')
if status ~= 'validating' and status ~= 'cancelling' then return status or 'missing' end
if redis.call('HGET', batch, 'line_count') then return status end
if outcome == 'failed' then
  redis.call('HSET', batch, 'status', 'failed', 'failed_at', now, 'errors', errors)
  redis.call('SREM', active, id)
  hook_event(batch, 'failed', 'batch.failed', now)
  return 'failed'
end
redis.call('HSET', batch, 'line_count', line_count, 'total', total, 'next_line', '0')
if status == 'validating' then
  redis.call('HSET', batch, 'status', 'in_progress', 'in_progress_at', now)
  return 'in_progress'
end
return status
