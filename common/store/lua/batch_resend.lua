-- Push a batch line's lost message again (common/store/batches.py resend).
-- KEYS: job broker
-- ARGV: now min_gap message
-- A batch line still queued although the batch's queue list is empty lost its message (a worker
-- died between popping it and taking the job, or Redis lost the last writes): push it again, once
-- per min_gap (s) since it was fed or last resent. A duplicate finds the job running and is dropped.
-- Returns 1 (pushed) or 0.
local job, broker = KEYS[1], KEYS[2]
local now, min_gap, message = ARGV[1], ARGV[2], ARGV[3]

if redis.call('HGET', job, 'status') ~= 'queued' then return 0 end
local since = math.max(tonumber(redis.call('HGET', job, 'created_at') or '0'),
                       tonumber(redis.call('HGET', job, 'requeued_at') or '0'))
if since > tonumber(now) - tonumber(min_gap) then return 0 end
redis.call('HSET', job, 'requeued_at', now)
redis.call('LPUSH', broker, message)
return 1
