"""The scripts of files and batches that carry the feeder's fence (common/store/batches.py).

The feeder's lease key holds ``token:fence``; the fence goes up by one each time another feeder
(or the same one after it lost the lease) takes it. A batch's result file is written into a list
of its own fence (``Keys.file_attempt``), every append and the commit check that the lease still
holds that value, and the commit checks the line count too: a feeder frozen mid-file and taken
over can write nothing after it wakes, and a file is committed whole or not at all.
"""

from common.store.hooks import HOOK_LIB

# KEYS: feeder key, fence counter. ARGV: this process's token, lease (ms).
# Returns the fence the lease is held with, or 0 when another process holds it.
CLAIM_FEEDER_LUA = """
local feeder, counter = KEYS[1], KEYS[2]
local token, lease_ms = ARGV[1], ARGV[2]
local holder = redis.call('GET', feeder)
if holder then
  local held_by, fence = string.match(holder, '^(.*):(%d+)$')
  if held_by ~= token then return 0 end
  redis.call('PEXPIRE', feeder, lease_ms)
  return tonumber(fence)
end
local fence = redis.call('INCR', counter)
redis.call('SET', feeder, token .. ':' .. fence, 'PX', lease_ms)
return fence
"""

# KEYS: feeder key, attempt list. ARGV: holder (token:fence), first line's index, ttl, line, ...
# Appends a page of a result file at its index: -1 when the fence is lost, -2 when the list does
# not end where the page starts; a page already appended (a retried call) is not appended again.
APPEND_ATTEMPT_LUA = """
local feeder, attempt = KEYS[1], KEYS[2]
local holder, start, ttl = ARGV[1], tonumber(ARGV[2]), ARGV[3]
if redis.call('GET', feeder) ~= holder then return -1 end
local n, count = redis.call('LLEN', attempt), #ARGV - 3
if n == start + count then return n end
if n ~= start then return -2 end
redis.call('RPUSH', attempt, unpack(ARGV, 4))
redis.call('EXPIRE', attempt, ttl)
return n + count
"""

# KEYS: feeder key, upload list, lines list, file hash, owner's files zset, owner's bytes hash,
#       owner's expiry zset.
# ARGV: holder ('' for an upload, which takes no lease), lines, ttl, created_at, file id, bytes,
#       field, value, ...
# The upload's lines become the file, with its object, at once, if the fence holds (-1) and the
# upload holds exactly ``lines`` lines (-2): a file is listed only whole. Writing the same file
# again (a batch's results assembled twice) replaces it.
COMMIT_FILE_LUA = """
local feeder, upload, lines, file, owner_files, owner_bytes, owner_expiry = unpack(KEYS)
local holder, count, ttl, created_at, file_id, size = unpack(ARGV, 1, 6)
if holder ~= '' and redis.call('GET', feeder) ~= holder then return -1 end
if redis.call('LLEN', upload) ~= tonumber(count) then return -2 end
redis.call('DEL', lines)
if redis.call('EXISTS', upload) == 1 then
  redis.call('RENAME', upload, lines)
  redis.call('EXPIRE', lines, ttl)
end
redis.call('DEL', file)
redis.call('HSET', file, unpack(ARGV, 7))
redis.call('EXPIRE', file, ttl)
redis.call('ZADD', owner_files, created_at, file_id)
redis.call('HSET', owner_bytes, file_id, size)
redis.call('ZADD', owner_expiry, tonumber(created_at) + tonumber(ttl), file_id)
for _, key in ipairs({owner_files, owner_bytes, owner_expiry}) do redis.call('EXPIRE', key, ttl) end
return 1
"""

# KEYS: owner's bytes hash, owner's expiry zset, owner's files zset. ARGV: now.
# An owner's stored files and their bytes, for its quota, once the files expired by now (at most
# 1,000 a call) are forgotten.
USAGE_LUA = """
local owner_bytes, owner_expiry, owner_files = unpack(KEYS)
local gone = redis.call('ZRANGEBYSCORE', owner_expiry, '-inf', ARGV[1], 'LIMIT', 0, 1000)
for _, id in ipairs(gone) do
  redis.call('HDEL', owner_bytes, id)
  redis.call('ZREM', owner_expiry, id)
  redis.call('ZREM', owner_files, id)
end
local total = 0
for _, n in ipairs(redis.call('HVALS', owner_bytes)) do total = total + tonumber(n) end
return {redis.call('HLEN', owner_bytes), total}
"""

# KEYS: batch hash, active set, window hash, results hash, feeder key.
# ARGV: batch id, now, ttl, output file id, error file id, completed, failed, holder.
# The batch's files are written: completed (or cancelled, expired, as it was ending), if the fence
# holds ('fenced' if not). Once: a second assembly finds it ended and changes nothing.
FINISH_LUA = (
    HOOK_LIB
    + """
local batch, active, window, results, feeder = unpack(KEYS)
if redis.call('GET', feeder) ~= ARGV[8] then return 'fenced' end
local status = redis.call('HGET', batch, 'status')
if status ~= 'finalizing' and status ~= 'cancelling' and status ~= 'in_progress' then
  return status or 'missing'
end
local final = redis.call('HGET', batch, 'ending') or 'completed'
redis.call('HSET', batch, 'status', final, 'output_file_id', ARGV[4], 'error_file_id', ARGV[5],
           'completed', ARGV[6], 'failed', ARGV[7])
if final ~= 'expired' then redis.call('HSET', batch, final .. '_at', ARGV[2]) end
redis.call('SREM', active, ARGV[1])
for _, key in ipairs({batch, window, results}) do redis.call('EXPIRE', key, ARGV[3]) end
hook_event(batch, final, 'batch.' .. final, ARGV[2])
return final
"""
)

# KEYS: batch hash, active set, window hash, results hash.
# ARGV: batch id, now, ttl, errors JSON.
# A batch the feeder cannot advance (an unexpected error, tick after tick) fails with the reason,
# so it stops taking the feeder's time. Returns the status it had.
FAIL_BATCH_LUA = (
    HOOK_LIB
    + """
local batch, active, window, results = unpack(KEYS)
local status = redis.call('HGET', batch, 'status')
if not status or status == 'completed' or status == 'failed' or status == 'expired'
   or status == 'cancelled' then
  redis.call('SREM', active, ARGV[1])
  return status or 'missing'
end
redis.call('HSET', batch, 'status', 'failed', 'failed_at', ARGV[2], 'errors', ARGV[4])
redis.call('SREM', active, ARGV[1])
for _, key in ipairs({batch, window, results}) do redis.call('EXPIRE', key, ARGV[3]) end
hook_event(batch, 'failed', 'batch.failed', ARGV[2])
return status
"""
)
