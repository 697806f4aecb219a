-- A page of a running batch's results moves out of Redis (common/store/batches.py spill).
-- KEYS: batch results feeder
-- ARGV: holder start lines name
-- holder: ``token:fence``. The page is lines start .. start + lines - 1, every one ended; its
-- results were written to the artifact ``name`` before. If the fence holds and the page is the
-- next one, its lines leave the results hash and the batch names the artifact
-- (``spilled_at:{start}``) and counts the lines spilled (``spilled``). Returns 1 if moved, 0 if
-- not (fenced, or another feeder moved it first: the caller deletes its artifact).
local batch, results, feeder = unpack(KEYS)
local holder, start, lines, name = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]

if redis.call('GET', feeder) ~= holder then return 0 end
if tonumber(redis.call('HGET', batch, 'spilled') or 0) ~= start then return 0 end
local fields = {}
for i = start, start + lines - 1 do fields[#fields + 1] = tostring(i) end
redis.call('HDEL', results, unpack(fields))
redis.call('HSET', batch, 'spilled', start + lines, 'spilled_at:' .. start, name)
return 1
