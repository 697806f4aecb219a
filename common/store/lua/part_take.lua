-- Take a part of a job to run it (common/store/calls.py part_take_args).
-- KEYS: part log queued running job channel queued_media
-- ARGV: id worker model deadline index
-- log, channel: the job's; id: the part's; index: the part's index in its job.
-- take.lua for a part: the same lease rule; the job runs from its first part's start; a part
-- event says who runs it (attempt). Now is Redis's clock, as in take.lua. Returns the job's log: the worker keeps the part's own events.
--#include redis_now
--#include parts
--#include take_lease
local part, log, queued, running, job, channel, queued_media = unpack(KEYS)
local id, worker, model, deadline, index = unpack(ARGV, 1, 5)
local now = redis_now()

local status = redis.call('HGET', part, 'status')
if not status then return {'missing'} end
local attempt, refused = take_lease(part, queued, running, id, worker, model, now, deadline, status)
if not attempt then return refused end
redis.call('ZREM', queued_media, id)
if redis.call('HGET', job, 'status') == 'queued' then
  redis.call('HSET', job, 'status', 'running', 'started_at', now)
  hook_event(job, 'start', 'job.started', now)
end
part_event(log, channel, '{"part":' .. index .. ',"status":"running","attempt":' .. attempt .. '}')
hook_event(job, 'part', 'job.part', now, tonumber(index))
return {'taken', tostring(attempt), redis.call('HGETALL', part), redis.call('LRANGE', log, 0, -1)}
