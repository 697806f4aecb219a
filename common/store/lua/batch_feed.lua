-- Feed a batch's next lines (common/store/batches.py feed).
-- KEYS: batch window results owner_jobs (job broker)[jobs]
-- ARGV: next_line next_after jobs rejected now index_age index_max (id window_value message n field[n])[jobs] (line result)[rejected]
-- Per job: its hash, the broker list of its message (its model's queue: Keys.model_queue), its
-- id, its value in the window, its message and its n fields and values. Per rejected line: its
-- index and result (JSON).
-- Each line becomes a job with its message (a job and its message exist together or not at all,
-- as in create.lua), in the window and in its owner's index (GET /v1/jobs, trimmed as create.lua
-- trims it); a line refused as the endpoint would refuse it gets its result at once. Only from
-- the expected line on, so two feeders never feed a line twice.
-- Returns 1 (fed), 0 (another feeder fed them first) or -1 (the batch is not running).
local batch, window, results, owner_jobs = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local next_line, next_after, jobs, rejected, now, index_age, index_max = unpack(ARGV, 1, 7)

if redis.call('HGET', batch, 'status') ~= 'in_progress' or redis.call('HGET', batch, 'ending') then
  return -1
end
if redis.call('HGET', batch, 'next_line') ~= next_line then return 0 end
local i, k = 8, 5
for _ = 1, tonumber(jobs) do
  local id, window_value, message, n = ARGV[i], ARGV[i + 1], ARGV[i + 2], tonumber(ARGV[i + 3])
  redis.call('HSET', KEYS[k], unpack(ARGV, i + 4, i + 3 + n))
  redis.call('LPUSH', KEYS[k + 1], message)
  redis.call('HSET', window, id, window_value)
  redis.call('ZADD', owner_jobs, now, id)
  i, k = i + 4 + n, k + 2
end
if tonumber(jobs) > 0 then
  redis.call('ZREMRANGEBYSCORE', owner_jobs, '-inf', '(' .. (tonumber(now) - tonumber(index_age)))
  redis.call('ZREMRANGEBYRANK', owner_jobs, 0, -tonumber(index_max) - 1)
  redis.call('EXPIRE', owner_jobs, index_age)
end
local failed = 0
for _ = 1, tonumber(rejected) do
  failed = failed + redis.call('HSETNX', results, ARGV[i], ARGV[i + 1])
  i = i + 2
end
redis.call('HINCRBY', batch, 'failed', failed)
redis.call('HSET', batch, 'next_line', next_after)
return 1
