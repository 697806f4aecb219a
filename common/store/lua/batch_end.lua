-- Stop feeding a batch (common/store/batches.py end_batch).
-- KEYS: batch
-- ARGV: now ending
-- ending: 'cancelled' (the batch is cancelling at once) or 'expired' (the end of its window: it
-- stays in_progress until its files are written). Nothing more is fed, the lines in the window
-- are cancelled. Returns the status the batch had.
local batch = KEYS[1]
local now, ending = ARGV[1], ARGV[2]

local status = redis.call('HGET', batch, 'status')
if not status then return 'missing' end
if (status ~= 'validating' and status ~= 'in_progress') or redis.call('HGET', batch, 'ending') then
  return status
end
redis.call('HSET', batch, 'ending', ending)
if ending == 'cancelled' then
  redis.call('HSET', batch, 'status', 'cancelling', 'cancelling_at', now)
else
  redis.call('HSET', batch, 'expired_at', now)
end
return status
