-- End a batch whose files are written, under the feeder's fence (common/store/batches.py finish).
-- KEYS: batch active window results feeder
-- ARGV: id now ttl output_file_id error_file_id completed failed holder
-- holder: ``token:fence``. The batch ends completed (or cancelled, expired, as it was ending), if
-- the fence holds ('fenced' if not). Once: a second assembly finds it ended and changes nothing.
-- Returns the batch's final status, or the status it had.
--#include hook_event
local batch, active, window, results, feeder = unpack(KEYS)
local id, now, ttl, output_file_id, error_file_id, completed, failed, holder = unpack(ARGV, 1, 8)

if redis.call('GET', feeder) ~= holder then return 'fenced' end
local status = redis.call('HGET', batch, 'status')
if status ~= 'finalizing' and status ~= 'cancelling' and status ~= 'in_progress' then
  return status or 'missing'
end
local final = redis.call('HGET', batch, 'ending') or 'completed'
redis.call('HSET', batch, 'status', final, 'output_file_id', output_file_id, 'error_file_id', error_file_id,
           'completed', completed, 'failed', failed)
if final ~= 'expired' then redis.call('HSET', batch, final .. '_at', now) end
redis.call('SREM', active, id)
for _, key in ipairs({batch, window, results}) do redis.call('EXPIRE', key, ttl) end
hook_event(batch, final, 'batch.' .. final, now)
return final
