-- Cancel a job: at once if queued, at its worker's next step if running (common/store/calls.py cancel_args).
-- KEYS: job log channel queued text queued_media held_media
-- ARGV: id ttl done cancelled
-- channel: the job's events (a shard channel, SPUBLISH: on a cluster only its slot's node
-- carries it); cancelled: the cancel channel the workers listen on (plain PUBLISH: on a cluster
-- that reaches every node, and a worker may listen on any; not a key, so in ARGV); done: the
-- done entry of a queued job (seq 1: its log is empty).
-- A job with parts: each queued part is cancelled at once (its part event), each running one is
-- told (as a running job is); the job ends once its last part has.
-- Returns 'cancelled', 'requested', 'missing' or the status of a job that ended already.
--#include redis_now
--#include parts
local job, log, channel, queued, text, queued_media, held_media = unpack(KEYS)
local id, ttl, done, cancelled = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local now = redis_now()  -- finished_at: Redis's clock, not the caller's

local status = redis.call('HGET', job, 'status')
if not status then return 'missing' end
if redis.call('HEXISTS', job, 'parts') == 1 then
  if status ~= 'queued' and status ~= 'running' then return status end
  redis.call('HSET', job, 'cancel_requested', '1')
  for i, k in ipairs(cjson.decode(redis.call('HGET', job, 'part_keys'))) do
    local st, part = unpack(redis.call('HMGET', k[1], 'status', 'id'))
    if st == 'queued' then
      local summary = '{"part":' .. (i - 1) .. ',"status":"cancelled"}'
      redis.call('HSET', k[1], 'status', 'cancelled', 'finish_reason', 'cancelled', 'finished_at', now,
                 'cancel_requested', '1', 'summary', summary)
      redis.call('ZREM', queued, part)
      redis.call('ZREM', queued_media, part)
      redis.call('ZREM', held_media, part)
      part_event(log, channel, summary)
      hook_event(job, 'part', 'job.part', now, i - 1)
    elseif st == 'running' then
      redis.call('HSET', k[1], 'cancel_requested', '1')
      redis.call('PUBLISH', cancelled, part)
    end
  end
  if finish_job(job, log, channel, text, now, ttl) then return 'cancelled' end
  return 'requested'
end
if status == 'queued' then
  if redis.call('LLEN', log) ~= 0 then return redis.error_reply('queued job with a non-empty log') end
  redis.call('HSET', job, 'status', 'cancelled', 'finish_reason', 'cancelled', 'finished_at', now,
             'cancel_requested', '1')
  redis.call('ZREM', queued, id)
  redis.call('RPUSH', log, done)
  redis.call('SPUBLISH', channel, done)
  redis.call('EXPIRE', job, ttl)
  redis.call('EXPIRE', log, ttl)
  hook_event(job, 'completed', 'job.completed', now)
  return 'cancelled'
end
if status == 'running' then
  redis.call('HSET', job, 'cancel_requested', '1')
  redis.call('PUBLISH', cancelled, id)
  return 'requested'
end
return status
