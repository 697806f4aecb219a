-- Create a job (common/store/calls.py create_call).
-- KEYS: queued job owner_jobs owner_queued broker? idem?
-- ARGV: max_queued max_owner_queued id now message idem_ttl index_age index_max (field value)*
-- broker: the broker list the message goes to (with a message); idem: the idempotency key (with
-- an idem_ttl). message and idem_ttl are '' for none; index_age (s) and index_max bound the owner's index.
-- With a message, it is pushed onto the broker list with the job: a job and its message exist
-- together or not at all. With an idempotency key that names a job already, nothing is created
-- and that job's id is returned (before the queue's limit: a retry of an accepted job is no new
-- load). The owner's index gets the job and loses the entries past its age or length, so it
-- never grows for good. max_owner_queued ('' for none: no API keys) bounds the owner's jobs
-- queued in this bucket: owner_queued holds the ids it queued here, and when it is full, those
-- no longer in ``queued`` (taken, cancelled, expired) are forgotten before it is counted again
-- (a requeued job forgotten so is not counted). Returns 1 (created), 0 (queue full), -1 (the
-- owner's share full) or that id.
local queued, job, owner_jobs, owner_queued = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local max_queued, max_owner_queued, id, now, message, idem_ttl, index_age, index_max = unpack(ARGV, 1, 8)
local broker = message ~= '' and KEYS[5]
local idem = idem_ttl ~= '' and KEYS[#KEYS]

if idem then
  local earlier = redis.call('GET', idem)
  if earlier then return earlier end
end
if redis.call('ZCARD', queued) >= tonumber(max_queued) then return 0 end
if max_owner_queued ~= '' then
  local most = tonumber(max_owner_queued)
  if redis.call('ZCARD', owner_queued) >= most then
    for _, q in ipairs(redis.call('ZRANGE', owner_queued, 0, -1)) do
      if not redis.call('ZSCORE', queued, q) then redis.call('ZREM', owner_queued, q) end
    end
    if redis.call('ZCARD', owner_queued) >= most then return -1 end
  end
  redis.call('ZADD', owner_queued, now, id)
  redis.call('EXPIRE', owner_queued, index_age)
end
redis.call('HSET', job, unpack(ARGV, 9))
redis.call('ZADD', queued, now, id)
redis.call('ZADD', owner_jobs, now, id)
redis.call('ZREMRANGEBYSCORE', owner_jobs, '-inf', '(' .. (tonumber(now) - tonumber(index_age)))
redis.call('ZREMRANGEBYRANK', owner_jobs, 0, -tonumber(index_max) - 1)
redis.call('EXPIRE', owner_jobs, index_age)
if broker then redis.call('LPUSH', broker, message) end
if idem then redis.call('SET', idem, id, 'EX', idem_ttl) end
return 1
