-- Record the results of a batch's lines (common/store/batches.py record).
-- KEYS: batch window results
-- ARGV: (job_id line kind result)*
-- job_id: '' for a line that never ran; kind: 'completed' or 'failed'; result: JSON.
-- A line's result is set once and counted once: a line that ran only while its job leaves the
-- window with it (a repeat, by a feeder that lost its lease, finds it gone; its page may have
-- left the results hash meanwhile: batch_spill.lua), one that never ran by HSETNX. So exactly
-- one result per line, whoever records it how often.
local batch, window, results = KEYS[1], KEYS[2], KEYS[3]

local counts = {completed = 0, failed = 0}
for i = 1, #ARGV, 4 do
  local job_id, line, kind, result = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  if job_id == '' or redis.call('HDEL', window, job_id) == 1 then
    counts[kind] = counts[kind] + redis.call('HSETNX', results, line, result)
  end
end
redis.call('HINCRBY', batch, 'completed', counts.completed)
redis.call('HINCRBY', batch, 'failed', counts.failed)
return 1
