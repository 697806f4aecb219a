-- take_lease(job, queued, running, id, worker, model, now, deadline, status): the lease rule of
-- take.lua and part_take.lua, for a job (or part) whose hash's status is `status`. A running job
-- is taken only once its lease lapsed; the attempt goes up, fencing out the worker before.
-- Returns the new attempt, or nil and the script's reply (busy, or finished).
local function take_lease(job, queued, running, id, worker, model, now, deadline, status)
  if status == 'running' then
    local lease = redis.call('ZSCORE', running, id)
    if lease and tonumber(lease) > tonumber(now) then return nil, {'busy', lease} end
  elseif status ~= 'queued' then
    return nil, {'finished', status}
  end
  local attempt = redis.call('HINCRBY', job, 'attempt', 1)
  redis.call('HSET', job, 'status', 'running', 'worker', worker, 'model', model)
  if status == 'queued' then
    redis.call('HSET', job, 'started_at', now)
    hook_event(job, 'start', 'job.started', now)
  end
  redis.call('ZREM', queued, id)
  redis.call('ZADD', running, deadline, id)
  return attempt
end
