-- Append a page of a batch's result file, under the feeder's fence (common/store/batches.py append_attempt).
-- KEYS: feeder attempt
-- ARGV: holder start ttl line*
-- attempt: the file's list of this fence (Keys.file_attempt); holder: ``token:fence``; start: the
-- first line's index. Returns the list's length, -1 when the fence is lost, -2 when the list does
-- not end where the page starts; a page already appended (a retried call) is not appended again.
local feeder, attempt = KEYS[1], KEYS[2]
local holder, start, ttl = ARGV[1], tonumber(ARGV[2]), ARGV[3]

if redis.call('GET', feeder) ~= holder then return -1 end
local n, count = redis.call('LLEN', attempt), #ARGV - 3
if n == start + count then return n end
if n ~= start then return -2 end
redis.call('RPUSH', attempt, unpack(ARGV, 4))
redis.call('EXPIRE', attempt, ttl)
return n + count
