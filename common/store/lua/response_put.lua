-- Attach a response's JSON to its job (common/store/responses.py put_response).
-- KEYS: job
-- ARGV: field response
-- Only on a job that exists: a job already expired must not come back as a hash without an
-- expiry. Returns 1, or 0 when the job is gone.
local job = KEYS[1]
local field, response = ARGV[1], ARGV[2]

if redis.call('EXISTS', job) == 0 then return 0 end
redis.call('HSET', job, field, response)
return 1
