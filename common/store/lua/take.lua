-- Take a job to run it (common/store/calls.py take_args).
-- KEYS: job log queued running text attempts
-- ARGV: id worker model deadline
-- deadline: the lease's end. Now (the lease's check, started_at, a webhook's event) is Redis's
-- clock, whatever the worker's clock says. A running job is taken over only when its lease lapsed (its worker
-- died or hung). The attempt is also recorded in the attempts hash, which fences the step writes
-- (append_step.lua). The text key covers the log up to the hash's text_seq. A job with a log but
-- no text key (the key was lost) gets the key again, built from its log (choice 0's tokens, as
-- records.job_text reads them).
-- Returns {'taken', attempt, the job's hash, its log}, {'busy', lease}, {'finished', status} or {'missing'}.
--#include redis_now
--#include hook_event
--#include take_lease
local job, log, queued, running, text, attempts = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local id, worker, model, deadline = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local now = redis_now()

local status = redis.call('HGET', job, 'status')
if not status then return {'missing'} end
if redis.call('HEXISTS', job, 'parts') == 1 then return {'finished', status} end
local attempt, refused = take_lease(job, queued, running, id, worker, model, now, deadline, status)
if not attempt then return refused end
redis.call('HSET', attempts, id, attempt)
local entries = redis.call('LRANGE', log, 0, -1)
if #entries > 0 then
  if redis.call('EXISTS', text) == 0 then
    local parts = {}
    for _, raw in ipairs(entries) do
      local entry = cjson.decode(raw)
      local choice = entry.data.choice
      if entry.type == 'token' and (not choice or choice == 0) then parts[#parts + 1] = entry.data.text end
    end
    redis.call('SET', text, table.concat(parts))
    redis.call('HSET', job, 'text_seq', #entries, 'text_len', redis.call('STRLEN', text))
  elseif redis.call('HEXISTS', job, 'text_seq') == 0 then
    -- a text key without the mark (a job with parts appends its text part's text at every event,
    -- part_append.lua): it covers the whole log so far
    redis.call('HSET', job, 'text_seq', #entries, 'text_len', redis.call('STRLEN', text))
  end
end
return {'taken', tostring(attempt), redis.call('HGETALL', job), entries}
