-- Claim the sending of a job's message again (common/store/sync.py).
-- KEYS: job running queued
-- ARGV: id now min_gap
-- The claim that makes one worker, and only one, send a job's message again: a running job whose
-- lease lapsed (its worker died), or a queued job whose message may have been lost. Once per
-- min_gap (s), so a requeue that itself got lost is retried, and duplicates stay rare (they are
-- harmless). Returns 1 (claimed) or 0.
local job, running, queued = KEYS[1], KEYS[2], KEYS[3]
local id, now, min_gap = ARGV[1], ARGV[2], ARGV[3]

local status = redis.call('HGET', job, 'status')
if status == 'running' then
  local lease = redis.call('ZSCORE', running, id)
  if lease and tonumber(lease) > tonumber(now) then return 0 end
elseif status == 'queued' then
  if not redis.call('ZSCORE', queued, id) then return 0 end
else
  redis.call('ZREM', running, id)
  redis.call('ZREM', queued, id)
  return 0
end
local last = tonumber(redis.call('HGET', job, 'requeued_at') or '0')
if last > tonumber(now) - tonumber(min_gap) then return 0 end
redis.call('HSET', job, 'requeued_at', now)
return 1
