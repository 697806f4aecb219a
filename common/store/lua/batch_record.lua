-- Record the results of a batch's lines (common/store/batches.py record).
-- KEYS: batch window results
-- ARGV: (job_id line kind result)*
-- job_id: '' for a line that never ran; kind: 'completed' or 'failed'; result: JSON.
-- A line's result is set once (HSETNX) and counted once, and its job leaves the window with it:
-- exactly one result per line, whoever records it how often.
local batch, window, results = KEYS[1], KEYS[2], KEYS[3]

local counts = {completed = 0, failed = 0}
for i = 1, #ARGV, 4 do
  local job_id, line, kind, result = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  counts[kind] = counts[kind] + redis.call('HSETNX', results, line, result)
  if job_id ~= '' then redis.call('HDEL', window, job_id) end
end
redis.call('HINCRBY', batch, 'completed', counts.completed)
redis.call('HINCRBY', batch, 'failed', counts.failed)
return 1
