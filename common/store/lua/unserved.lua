-- A queued job whose model no live worker serves (common/store/sync.py unserved, workers/reaper.py).
-- KEYS: job log channel queued
-- ARGV: id from to ttl entry error
-- from: the queue the sweep found it in (its hash's queue); a job no longer queued there is left
-- alone (taken, cancelled, or handled by another worker's sweep). to: a live model's queue, where it
-- moves (the caller sends its message there); '' fails it instead: status failed, error (JSON) in
-- its hash, entry (its terminal error event, seq 1: a queued job's log is empty) in its log.
-- Returns 'moved', 'failed' or 'left'.
--#include redis_now
--#include hook_event
local job, log, channel, queued = unpack(KEYS)
local id, from, to, ttl, entry, error_json = unpack(ARGV, 1, 6)

local status, queue = unpack(redis.call('HMGET', job, 'status', 'queue'))
if status ~= 'queued' or queue ~= from or redis.call('LLEN', log) ~= 0 then return 'left' end
if to ~= '' then
  redis.call('HSET', job, 'queue', to)
  return 'moved'
end
local now = redis_now()
redis.call('HSET', job, 'status', 'failed', 'finish_reason', 'error', 'finished_at', now, 'error', error_json)
redis.call('ZREM', queued, id)
redis.call('RPUSH', log, entry)
redis.call('SPUBLISH', channel, entry)
redis.call('EXPIRE', job, ttl)
redis.call('EXPIRE', log, ttl)
hook_event(job, 'completed', 'job.completed', now)
return 'failed'
