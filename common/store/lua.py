"""The Lua scripts of the job store (common/store/).

Every status transition and every append is one script, so each is atomic without WATCH
retries, and each is safe to run twice (a retried call after a dropped connection is a no-op).
The scripts that record an event with a webhook record its delivery too (``hook_event``:
common/store/hooks.py).
"""

from common.store.hooks import HOOK_LIB

# KEYS: queued zset, job hash, owner's job index[, broker list][, idempotency key].
# ARGV: max queued, job id, now, message ('' for none), idempotency TTL ('' for none),
#       index max age (s), index max length, field, value, ...
# With a message, it is pushed onto the broker list with the job: a job and its message exist
# together or not at all. With an idempotency key that names a job already, nothing is created
# and that job's id is returned (before the queue's limit: a retry of an accepted job is no new
# load). The owner's index gets the job and loses the entries past its age or length, so it
# never grows for good. Returns 1 (created), 0 (queue full) or that id.
CREATE_LUA = """
local idem = ARGV[5] ~= '' and KEYS[#KEYS]
if idem then
  local earlier = redis.call('GET', idem)
  if earlier then return earlier end
end
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('HSET', KEYS[2], unpack(ARGV, 8))
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[2])
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. (tonumber(ARGV[3]) - tonumber(ARGV[6])))
redis.call('ZREMRANGEBYRANK', KEYS[3], 0, -tonumber(ARGV[7]) - 1)
redis.call('EXPIRE', KEYS[3], ARGV[6])
if ARGV[4] ~= '' then redis.call('LPUSH', KEYS[4], ARGV[4]) end
if idem then redis.call('SET', idem, ARGV[2], 'EX', ARGV[5]) end
return 1
"""

# The lease rule both takes share (KEYS[1] the hash, [3] queued, [4] running; ARGV[1] the id,
# [2] worker, [3] model, [4] now, [5] lease deadline; `status` read): a running job is taken only
# once its lease lapsed; the attempt goes up, fencing out the worker before.
_TAKE_LEASE = """\
if status == 'running' then
  local lease = redis.call('ZSCORE', KEYS[4], ARGV[1])
  if lease and tonumber(lease) > tonumber(ARGV[4]) then return {'busy', lease} end
elseif status ~= 'queued' then
  return {'finished', status}
end
local attempt = redis.call('HINCRBY', KEYS[1], 'attempt', 1)
redis.call('HSET', KEYS[1], 'status', 'running', 'worker', ARGV[2], 'model', ARGV[3])
if status == 'queued' then
  redis.call('HSET', KEYS[1], 'started_at', ARGV[4])
  hook_event(KEYS[1], 'start', 'job.started', ARGV[4])
end
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZADD', KEYS[4], ARGV[5], ARGV[1])
"""

# KEYS: job hash, log, queued zset, running zset, text, attempts hash. ARGV: job id, worker, model,
# now, lease deadline.
# A running job is taken over only when its lease lapsed (its worker died or hung). The attempt is
# also recorded in the attempts hash, which fences the step writes (APPEND_STEP_LUA). The text key
# covers the log up to the hash's text_seq; a job whose log has no such mark (written by a worker
# of an older version, which appended the text at every step) gets it, and one without a text key
# gets the key, built from its log (choice 0's tokens: records.job_text).
TAKE_LUA = (
    HOOK_LIB
    + """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {'missing'} end
if redis.call('HEXISTS', KEYS[1], 'parts') == 1 then return {'finished', status} end
"""
    + _TAKE_LEASE
    + """redis.call('HSET', KEYS[6], ARGV[1], attempt)
local log = redis.call('LRANGE', KEYS[2], 0, -1)
if #log > 0 then
  if redis.call('EXISTS', KEYS[5]) == 0 then
    local text = {}
    for _, raw in ipairs(log) do
      local entry = cjson.decode(raw)
      local choice = entry.data.choice
      if entry.type == 'token' and (not choice or choice == 0) then text[#text + 1] = entry.data.text end
    end
    redis.call('SET', KEYS[5], table.concat(text))
    redis.call('HSET', KEYS[1], 'text_seq', #log, 'text_len', redis.call('STRLEN', KEYS[5]))
  elseif redis.call('HEXISTS', KEYS[1], 'text_seq') == 0 then
    redis.call('HSET', KEYS[1], 'text_seq', #log, 'text_len', redis.call('STRLEN', KEYS[5]))
  end
end
return {'taken', tostring(attempt), redis.call('HGETALL', KEYS[1]), log}
"""
)

# One engine step's writes, for every job in it (several steps' when the writer fell behind).
# KEYS: running zset, attempts hash, then for each append: job hash, log, job channel, text.
# ARGV: ttl, finished_at, then for each append: attempt, first seq, prompt tokens, completion
#       tokens, final status ('' if not final), finish reason, error JSON, job id, '1' for a
#       checkpoint ('' if not), the text since the last checkpoint, the number of entries n, then
#       its n entries.
# Returns one answer per append, in order: 1 written, 2 written by an earlier try (a retried
# call after a dropped connection: a no-op, not a duplicate), 0 fenced (another attempt holds
# the job), -1 a gap (the log does not end just before the first entry). Appends of one job
# follow each other in seq order, so each finds the log as the one before it left it.
# A step costs, per token, RPUSH and PUBLISH; the fencing is one HMGET of the attempts hash for
# the whole call (a job missing there, whose last append is written already or that an older
# worker took, is fenced by its hash's attempt); the text key and the hash's counts are written
# at a checkpoint only (the writer sends one every few events, with the first and the last):
# APPEND, then HSET of the counts, text_seq (the log length the text covers) and text_len (its
# bytes), so a reader takes text_len bytes of the text and the log after text_seq.
# NOTE: the log's length is checked with RPUSH's answer rather than an LLEN first (one command
# per token fewer); a push that finds the log elsewhere than expected is undone at once, inside
# the script, so nobody sees it. A script's writes are refused as a whole (out of memory or a
# read-only replica refuse its first write), never halfway.
APPEND_STEP_LUA = (
    HOOK_LIB
    + """
local function push(log, expected_len, from, to)
  local len = redis.call('RPUSH', log, unpack(ARGV, from, to))
  if len == expected_len then return 1 end
  local before = len - (to - from + 1)
  if before == 0 then redis.call('DEL', log) else redis.call('LTRIM', log, 0, before - 1) end
  if before >= expected_len then return 2 end
  return -1
end

local function append(job, log, channel, text, a, held)
  local n = tonumber(ARGV[a + 10])
  if not held then held = redis.call('HGET', job, 'attempt') end
  if held ~= ARGV[a] then return 0 end
  local last = tonumber(ARGV[a + 1]) - 1 + n
  if n == 0 then
    if redis.call('LLEN', log) ~= last then return -1 end
  else
    local pushed = push(log, last, a + 11, a + 10 + n)
    if pushed ~= 1 then return pushed end
    for i = a + 11, a + 10 + n do redis.call('PUBLISH', channel, ARGV[i]) end
  end
  local final = ARGV[a + 4] ~= ''
  if ARGV[a + 8] == '' and not final then return 1 end
  local fields = {'prompt_tokens', ARGV[a + 2], 'completion_tokens', ARGV[a + 3], 'text_seq', last,
                  'text_len', redis.call('APPEND', text, ARGV[a + 9])}
  if final then
    for _, v in ipairs({'status', ARGV[a + 4], 'finish_reason', ARGV[a + 5], 'finished_at', ARGV[2],
                        'error', ARGV[a + 6]}) do fields[#fields + 1] = v end
  end
  redis.call('HSET', job, unpack(fields))
  if final then
    redis.call('ZREM', KEYS[1], ARGV[a + 7])
    redis.call('HDEL', KEYS[2], ARGV[a + 7])
    redis.call('EXPIRE', job, ARGV[1])
    redis.call('EXPIRE', log, ARGV[1])
    redis.call('EXPIRE', text, ARGV[1])
    hook_event(job, 'completed', 'job.completed', ARGV[2])
  end
  return 1
end

local ids, a = {}, 3
for _ = 3, #KEYS, 4 do
  ids[#ids + 1] = ARGV[a + 7]
  a = a + 11 + tonumber(ARGV[a + 10])
end
if #ids == 0 then return {} end
local held = redis.call('HMGET', KEYS[2], unpack(ids))
local answers = {}
a = 3
for k = 3, #KEYS, 4 do
  answers[#answers + 1] = append(KEYS[k], KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], a, held[#answers + 1])
  a = a + 11 + tonumber(ARGV[a + 10])
end
return answers
"""
)

# Shared by the scripts of jobs with parts. A part's hash is ``Keys.job(part id)``; the job's hash
# holds ``part_keys``: per part [hash, text, content] (names from common/keys.py). A part's
# ``summary`` is the data of the event that ended it; the job's ``done`` lists them all.
PARTS_LIB = (
    HOOK_LIB
    + """
local function part_event(log, chan, data, kind)
  local seq = redis.call('LLEN', log) + 1
  local entry = '{"seq":' .. seq .. ',"type":"' .. (kind or 'part') .. '","data":' .. data .. '}'
  redis.call('RPUSH', log, entry)
  redis.call('PUBLISH', chan, entry)
end
-- Once every part has ended: the job's status from theirs, its done event, and the expiries.
local function finish_job(job, log, chan, text, now, ttl)
  local pk = cjson.decode(redis.call('HGET', job, 'part_keys'))
  local summaries, ok, bad = {}, 0, 0
  for i, k in ipairs(pk) do
    local st, sm = unpack(redis.call('HMGET', k[1], 'status', 'summary'))
    if st == 'succeeded' then ok = ok + 1
    elseif st == 'failed' or st == 'cancelled' then bad = bad + 1
    else return false end
    summaries[i] = sm
  end
  local status = 'partial'
  if redis.call('HGET', job, 'cancel_requested') == '1' then status = 'cancelled'
  elseif bad == 0 then status = 'succeeded'
  elseif ok == 0 then status = 'failed' end
  local done = '{"status":"' .. status .. '","parts":[' .. table.concat(summaries, ',') .. ']}'
  part_event(log, chan, done, 'done')
  redis.call('HSET', job, 'status', status, 'finished_at', now)
  hook_event(job, 'completed', 'job.completed', now)
  for _, key in ipairs({job, log, text}) do redis.call('EXPIRE', key, ttl) end
  for _, k in ipairs(pk) do
    for _, key in ipairs(k) do redis.call('EXPIRE', key, ttl) end
  end
  return true
end
-- Send a queued image part's stored message (a prompt_from or held part's: CREATE_PARTS_LUA kept
-- it in its hash), and count it in the queued media zset from now on.
local function send_part(key, queued_media, now)
  local list, message, id = unpack(redis.call('HMGET', key, 'list_key', 'message', 'id'))
  if not message then return end
  redis.call('LPUSH', list, message)
  redis.call('ZADD', queued_media, now, id)
end
-- Send the messages of the job's held image parts (``held_parts``) still queued: its text parts
-- have their first tokens (PART_APPEND_LUA), or the hold's bound passed (RELEASE_HELD_LUA).
local function release_held(job, queued_media, held_media, now)
  local held = redis.call('HGET', job, 'held_parts')
  if not held then return end
  redis.call('HDEL', job, 'held_parts')
  local pk = cjson.decode(redis.call('HGET', job, 'part_keys'))
  for _, d in ipairs(cjson.decode(held)) do
    local key = pk[d + 1][1]
    local status, id = unpack(redis.call('HMGET', key, 'status', 'id'))
    redis.call('ZREM', held_media, id)
    if status == 'queued' then
      send_part(key, queued_media, now)
      redis.call('HSET', key, 'released_at', now)
    end
  end
end
"""
)

# KEYS: job hash, log, job channel, queued zset, cancel channel, running zset, text, queued media zset,
#       held media zset.
# ARGV: job id, now, ttl, the done entry (seq 1: a queued job's log is empty).
# A job with parts: each queued part is cancelled at once (its part event), each running one is
# told (as a running job is); the job ends once its last part has.
CANCEL_LUA = (
    PARTS_LIB
    + """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 'missing' end
if redis.call('HEXISTS', KEYS[1], 'parts') == 1 then
  if status ~= 'queued' and status ~= 'running' then return status end
  redis.call('HSET', KEYS[1], 'cancel_requested', '1')
  for i, k in ipairs(cjson.decode(redis.call('HGET', KEYS[1], 'part_keys'))) do
    local st, id = unpack(redis.call('HMGET', k[1], 'status', 'id'))
    if st == 'queued' then
      local summary = '{"part":' .. (i - 1) .. ',"status":"cancelled"}'
      redis.call('HSET', k[1], 'status', 'cancelled', 'finish_reason', 'cancelled', 'finished_at', ARGV[2],
                 'cancel_requested', '1', 'summary', summary)
      redis.call('ZREM', KEYS[4], id)
      redis.call('ZREM', KEYS[8], id)
      redis.call('ZREM', KEYS[9], id)
      part_event(KEYS[2], KEYS[3], summary)
      hook_event(KEYS[1], 'part', 'job.part', ARGV[2], i - 1)
    elseif st == 'running' then
      redis.call('HSET', k[1], 'cancel_requested', '1')
      redis.call('PUBLISH', KEYS[5], id)
    end
  end
  if finish_job(KEYS[1], KEYS[2], KEYS[3], KEYS[7], ARGV[2], ARGV[3]) then return 'cancelled' end
  return 'requested'
end
if status == 'queued' then
  if redis.call('LLEN', KEYS[2]) ~= 0 then return redis.error_reply('queued job with a non-empty log') end
  redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finish_reason', 'cancelled', 'finished_at', ARGV[2],
             'cancel_requested', '1')
  redis.call('ZREM', KEYS[4], ARGV[1])
  redis.call('RPUSH', KEYS[2], ARGV[4])
  redis.call('PUBLISH', KEYS[3], ARGV[4])
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  redis.call('EXPIRE', KEYS[2], ARGV[3])
  hook_event(KEYS[1], 'completed', 'job.completed', ARGV[2])
  return 'cancelled'
end
if status == 'running' then
  redis.call('HSET', KEYS[1], 'cancel_requested', '1')
  redis.call('PUBLISH', KEYS[5], ARGV[1])
  return 'requested'
end
return status
"""
)


# KEYS: running zset, job hash, job hash, ... ARGV: lease deadline, job id, attempt, job id, attempt, ...
# Renews the leases of the jobs a worker still holds (attempt unchanged); returns the ids it lost
# (taken over, or expired). A job that ended at the worker's attempt is not lost: that worker
# wrote its end (a renewal racing the job's last append must not read as a take-over).
# With a deadline of 0 it lapses them instead (a restarted worker releasing its earlier run's jobs).
# Fenced like the appends: a worker that was taken over must not keep the new holder's lease alive.
RENEW_LUA = """
local lost = {}
for i = 2, #KEYS do
  local id, attempt = ARGV[2 * i - 2], ARGV[2 * i - 1]
  if redis.call('HGET', KEYS[i], 'attempt') ~= attempt then
    lost[#lost + 1] = id
  elseif redis.call('HGET', KEYS[i], 'status') == 'running' then
    redis.call('ZADD', KEYS[1], 'XX', ARGV[1], id)
  end
end
return lost
"""

# KEYS: job hash, running zset, queued zset. ARGV: job id, now, min gap between two requeues (s).
# The claim that makes one worker, and only one, send a job's message again: a running job whose
# lease lapsed (its worker died), or a queued job whose message may have been lost. Once per gap,
# so a requeue that itself got lost is retried, and duplicates stay rare (they are harmless).
REQUEUE_LUA = """
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'running' then
  local lease = redis.call('ZSCORE', KEYS[2], ARGV[1])
  if lease and tonumber(lease) > tonumber(ARGV[2]) then return 0 end
elseif status == 'queued' then
  if not redis.call('ZSCORE', KEYS[3], ARGV[1]) then return 0 end
else
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('ZREM', KEYS[3], ARGV[1])
  return 0
end
local last = tonumber(redis.call('HGET', KEYS[1], 'requeued_at') or '0')
if last > tonumber(ARGV[2]) - tonumber(ARGV[3]) then return 0 end
redis.call('HSET', KEYS[1], 'requeued_at', ARGV[2])
return 1
"""


# KEYS: attempts hash, then the hash of each job. ARGV: the job ids, in the same order.
# Drops the attempts fields of the jobs that no longer run: their hash went while they ran (lost,
# deleted, or expired) or they ended without their last append dropping the field (a worker of an
# older version). A field is written only with `running` (TAKE_LUA) and a job never runs again
# once ended, so a job read here as not running has no use for it: its hash's attempt fences it.
# Returns how many fields it dropped.
DROP_ATTEMPTS_LUA = """
local dropped = 0
for i = 2, #KEYS do
  if redis.call('HGET', KEYS[i], 'status') ~= 'running' then
    dropped = dropped + redis.call('HDEL', KEYS[1], ARGV[i - 1])
  end
end
return dropped
"""

# -- files and batches (common/store/batches.py; the fenced ones: common/store/batch_lua.py) -------

# KEYS: batch hash, active set. ARGV: batch id, 'ok' | 'failed', now, line count, total, errors JSON.
# The end of a batch's validation: in_progress with its counts, or failed with the lines' errors.
# A batch cancelled while it was validated stays cancelling (with its counts, if valid).
VALIDATED_LUA = (
    HOOK_LIB
    + """
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'validating' and status ~= 'cancelling' then return status or 'missing' end
if redis.call('HGET', KEYS[1], 'line_count') then return status end
if ARGV[2] == 'failed' then
  redis.call('HSET', KEYS[1], 'status', 'failed', 'failed_at', ARGV[3], 'errors', ARGV[6])
  redis.call('SREM', KEYS[2], ARGV[1])
  hook_event(KEYS[1], 'failed', 'batch.failed', ARGV[3])
  return 'failed'
end
redis.call('HSET', KEYS[1], 'line_count', ARGV[4], 'total', ARGV[5], 'next_line', '0')
if status == 'validating' then
  redis.call('HSET', KEYS[1], 'status', 'in_progress', 'in_progress_at', ARGV[3])
  return 'in_progress'
end
return status
"""
)

# KEYS: batch hash, window hash, results hash, owner's job index, then per job: its hash, the broker
#       list of its message (its model's queue: Keys.model_queue).
# ARGV: next line expected, next line after, jobs, rejected lines, now, index max age (s), index
#       max length, then per job: job id, window value, message, field count n, n fields and values;
#       then per rejected line: line index, result JSON.
# Feeds a batch's next lines: each becomes a job with its message (a job and its message exist
# together or not at all, as in CREATE_LUA), in the window and in its owner's index (GET /v1/jobs,
# trimmed as CREATE_LUA trims it); a line refused as the endpoint would refuse it gets its result
# at once. Only from the expected line on, so two feeders never feed a line twice.
FEED_LUA = """
if redis.call('HGET', KEYS[1], 'status') ~= 'in_progress' or redis.call('HGET', KEYS[1], 'ending') then
  return -1
end
if redis.call('HGET', KEYS[1], 'next_line') ~= ARGV[1] then return 0 end
local i, k = 8, 5
for _ = 1, tonumber(ARGV[3]) do
  local n = tonumber(ARGV[i + 3])
  redis.call('HSET', KEYS[k], unpack(ARGV, i + 4, i + 3 + n))
  redis.call('LPUSH', KEYS[k + 1], ARGV[i + 2])
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
  redis.call('ZADD', KEYS[4], ARGV[5], ARGV[i])
  i, k = i + 4 + n, k + 2
end
if tonumber(ARGV[3]) > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', '(' .. (tonumber(ARGV[5]) - tonumber(ARGV[6])))
  redis.call('ZREMRANGEBYRANK', KEYS[4], 0, -tonumber(ARGV[7]) - 1)
  redis.call('EXPIRE', KEYS[4], ARGV[6])
end
local failed = 0
for _ = 1, tonumber(ARGV[4]) do
  failed = failed + redis.call('HSETNX', KEYS[3], ARGV[i], ARGV[i + 1])
  i = i + 2
end
redis.call('HINCRBY', KEYS[1], 'failed', failed)
redis.call('HSET', KEYS[1], 'next_line', ARGV[2])
return 1
"""

# KEYS: batch hash, window hash, results hash. ARGV: per line: job id ('' for none), line index,
# 'completed' | 'failed', result JSON.
# A line's result is set once (HSETNX) and counted once, and its job leaves the window with it:
# exactly one result per line, whoever records it how often.
RECORD_LUA = """
local counts = {completed = 0, failed = 0}
for i = 1, #ARGV, 4 do
  counts[ARGV[i + 2]] = counts[ARGV[i + 2]] + redis.call('HSETNX', KEYS[3], ARGV[i + 1], ARGV[i + 3])
  if ARGV[i] ~= '' then redis.call('HDEL', KEYS[2], ARGV[i]) end
end
redis.call('HINCRBY', KEYS[1], 'completed', counts.completed)
redis.call('HINCRBY', KEYS[1], 'failed', counts.failed)
return 1
"""

# KEYS: batch hash. ARGV: now, 'cancelled' | 'expired'.
# A cancel (cancelling at once) or the end of the window (the batch stays in_progress until its
# files are written): nothing more is fed, the lines in the window are cancelled. Returns the
# status the batch had.
END_LUA = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 'missing' end
if (status ~= 'validating' and status ~= 'in_progress') or redis.call('HGET', KEYS[1], 'ending') then
  return status
end
redis.call('HSET', KEYS[1], 'ending', ARGV[2])
if ARGV[2] == 'cancelled' then
  redis.call('HSET', KEYS[1], 'status', 'cancelling', 'cancelling_at', ARGV[1])
else
  redis.call('HSET', KEYS[1], 'expired_at', ARGV[1])
end
return status
"""

# KEYS: batch hash. ARGV: now. Every line has its result: in_progress -> finalizing.
FINALIZING_LUA = """
if redis.call('HGET', KEYS[1], 'status') ~= 'in_progress' or redis.call('HGET', KEYS[1], 'ending') then
  return 0
end
redis.call('HSET', KEYS[1], 'status', 'finalizing', 'finalizing_at', ARGV[1])
return 1
"""

# KEYS: the batches' index, then per batch its hash and its window hash.
# ARGV: the statuses of the batches not ended, '', then the batch ids.
# For /metrics, in one call: the batches by status, then (after an empty string) the lines of the
# batches not ended by state: pending (not fed), in flight (in the window), completed, failed.
# A batch whose hash expired is skipped, and leaves the index.
BATCH_COUNTS_LUA = """
local live, ids = {}, 0
for i, status in ipairs(ARGV) do
  if status == '' then ids = i; break end
  live[status] = true
end
local statuses, order = {}, {}
local pending, in_flight, completed, failed = 0, 0, 0, 0
for i = 2, #KEYS, 2 do
  local h = redis.call('HMGET', KEYS[i], 'status', 'total', 'completed', 'failed')
  local status = h[1]
  if not status then redis.call('ZREM', KEYS[1], ARGV[ids + i / 2]) end
  if status then
    if not statuses[status] then statuses[status] = 0; order[#order + 1] = status end
    statuses[status] = statuses[status] + 1
    if live[status] then
      local window = redis.call('HLEN', KEYS[i + 1])
      local c, f = tonumber(h[3] or '0'), tonumber(h[4] or '0')
      pending = pending + math.max(tonumber(h[2] or '0') - c - f - window, 0)
      in_flight, completed, failed = in_flight + window, completed + c, failed + f
    end
  end
end
local out = {}
for _, status in ipairs(order) do out[#out + 1] = status; out[#out + 1] = statuses[status] end
out[#out + 1] = ''
out[#out + 1] = pending; out[#out + 1] = in_flight; out[#out + 1] = completed; out[#out + 1] = failed
return out
"""

# KEYS: job hash, broker list. ARGV: now, min gap (s), message.
# A batch line still queued although the batch's queue list is empty lost its message (a worker
# died between popping it and taking the job, or Redis lost the last writes): push it again, once
# per gap since it was fed or last resent. A duplicate finds the job running and is dropped.
RESEND_LUA = """
if redis.call('HGET', KEYS[1], 'status') ~= 'queued' then return 0 end
local since = math.max(tonumber(redis.call('HGET', KEYS[1], 'created_at') or '0'),
                       tonumber(redis.call('HGET', KEYS[1], 'requeued_at') or '0'))
if since > tonumber(ARGV[1]) - tonumber(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[1], 'requeued_at', ARGV[1])
redis.call('LPUSH', KEYS[2], ARGV[3])
return 1
"""


# KEYS: queued zset, job hash, owner's job index[, idempotency key].
# ARGV: max queued, job id, now, idempotency TTL ('' for none), the job's fields (JSON object),
#       its parts (JSON array of {id, key, fields, zset, score, push, list, message}),
#       index max age (s), index max length.
# CREATE_LUA for a job with parts: the job and every part's hash, and the messages of the parts
# that can start now (a part with prompt_from keeps its message until its text part succeeded, a
# held one until its job's text parts have their first tokens: PARTS_LIB's release_held).
# Text parts are queued jobs (backpressure, the sweep's lost messages); an image part whose
# message is sent goes into the queued media zset (the sweep's lost messages only), a held one
# into the held media zset (scored with the latest it is sent); the job itself never is queued.
CREATE_PARTS_LUA = """
local idem = ARGV[4] ~= '' and KEYS[4]
if idem then
  local earlier = redis.call('GET', idem)
  if earlier then return earlier end
end
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
local function hset(key, fields)
  local flat = {}
  for k, v in pairs(fields) do flat[#flat + 1] = k; flat[#flat + 1] = v end
  redis.call('HSET', key, unpack(flat))
end
hset(KEYS[2], cjson.decode(ARGV[5]))
for _, p in ipairs(cjson.decode(ARGV[6])) do
  hset(p.key, p.fields)
  if p.zset ~= '' then redis.call('ZADD', p.zset, p.score, p.id) end
  if p.push then redis.call('LPUSH', p.list, p.message) end
end
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. (tonumber(ARGV[3]) - tonumber(ARGV[7])))
redis.call('ZREMRANGEBYRANK', KEYS[3], 0, -tonumber(ARGV[8]) - 1)
redis.call('EXPIRE', KEYS[3], ARGV[7])
if idem then redis.call('SET', idem, ARGV[2], 'EX', ARGV[4]) end
return 1
"""

# KEYS: part hash, job log, queued zset, running zset, job hash, job channel, queued media zset.
# ARGV: part id, worker, model, now, lease deadline, part index.
# TAKE_LUA for a part: the same lease rule; the job runs from its first part's start; a part
# event says who runs it (attempt). Returns the job's log: the worker keeps the part's own events.
PART_TAKE_LUA = (
    PARTS_LIB
    + """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {'missing'} end
"""
    + _TAKE_LEASE
    + """redis.call('ZREM', KEYS[7], ARGV[1])
if redis.call('HGET', KEYS[5], 'status') == 'queued' then
  redis.call('HSET', KEYS[5], 'status', 'running', 'started_at', ARGV[4])
  hook_event(KEYS[5], 'start', 'job.started', ARGV[4])
end
part_event(KEYS[2], KEYS[6], '{"part":' .. ARGV[6] .. ',"status":"running","attempt":' .. attempt .. '}')
hook_event(KEYS[5], 'part', 'job.part', ARGV[4], tonumber(ARGV[6]))
return {'taken', tostring(attempt), redis.call('HGETALL', KEYS[1]), redis.call('LRANGE', KEYS[2], 0, -1)}
"""
)

# KEYS: part hash, job log, job channel, running zset, part text, job hash, job text, part content,
#       queued media zset, held media zset.
# ARGV: attempt, first seq (the part's own count of events), prompt tokens, completion tokens,
#       final status ('' if not final), finish reason, finished_at, error JSON, ttl, part id,
#       the entries' text, the summary (JSON: the last entry's data, when final), content ('' for
#       none), part index, entry, entry, ...
# APPEND_LUA for a part: fenced by the part's attempt and idempotent by its own event count
# (``logged``); each entry gets the job log's next seq. A text part's first append (its first
# token, or its end) counts toward sending its job's held image parts. The part's last append
# stores its summary and content, starts or fails the parts that take their prompt from it, and
# ends the job when no part is left.
PART_APPEND_LUA = (
    PARTS_LIB
    + """
if redis.call('HGET', KEYS[1], 'attempt') ~= ARGV[1] then return 0 end
local n = #ARGV - 14
local logged = tonumber(redis.call('HGET', KEYS[1], 'logged') or '0')
local first = tonumber(ARGV[2])
if logged >= first - 1 + n and n > 0 then return 2 end
if logged ~= first - 1 then return -1 end
for i = 15, #ARGV do
  local seq = redis.call('LLEN', KEYS[2]) + 1
  local entry = (string.gsub(ARGV[i], '^{"seq":%d+,', '{"seq":' .. seq .. ',', 1))
  redis.call('RPUSH', KEYS[2], entry)
  redis.call('PUBLISH', KEYS[3], entry)
end
redis.call('HSET', KEYS[1], 'logged', logged + n, 'prompt_tokens', ARGV[3], 'completion_tokens', ARGV[4])
if logged == 0 and n > 0 and redis.call('HGET', KEYS[1], 'holds') == '1'
   and redis.call('HINCRBY', KEYS[6], 'text_waiting', -1) <= 0 then
  release_held(KEYS[6], KEYS[9], KEYS[10], ARGV[7])
end
if ARGV[11] ~= '' then
  redis.call('APPEND', KEYS[5], ARGV[11])
  redis.call('APPEND', KEYS[7], ARGV[11])
end
if ARGV[5] == '' then return 1 end
redis.call('HSET', KEYS[1], 'status', ARGV[5], 'finish_reason', ARGV[6], 'finished_at', ARGV[7],
           'error', ARGV[8], 'summary', ARGV[12])
hook_event(KEYS[6], 'part', 'job.part', ARGV[7], tonumber(ARGV[14]))
redis.call('ZREM', KEYS[4], ARGV[10])
if ARGV[13] ~= '' then redis.call('SET', KEYS[8], ARGV[13], 'EX', ARGV[9]) end
local deps = redis.call('HGET', KEYS[1], 'dependents')
if deps then
  local pk = cjson.decode(redis.call('HGET', KEYS[6], 'part_keys'))
  for _, d in ipairs(cjson.decode(deps)) do
    local key = pk[d + 1][1]
    if redis.call('HGET', key, 'status') == 'queued' then
      if ARGV[5] == 'succeeded' then
        send_part(key, KEYS[9], ARGV[7])
      else
        local err = '{"message":"part ' .. ARGV[14] .. ', which this part takes its prompt from, ' ..
                    ARGV[5] .. '","type":"dependency_failed"}'
        local summary = '{"part":' .. d .. ',"status":"failed","error":' .. err .. '}'
        redis.call('HSET', key, 'status', 'failed', 'finish_reason', 'error', 'finished_at', ARGV[7],
                   'error', err, 'summary', summary)
        part_event(KEYS[2], KEYS[3], summary)
        hook_event(KEYS[6], 'part', 'job.part', ARGV[7], d)
      end
    end
  end
end
finish_job(KEYS[6], KEYS[2], KEYS[3], KEYS[7], ARGV[7], ARGV[9])
return 1
"""
)

# KEYS: held media zset, queued media zset, job hash, job hash, ... ARGV: now, part id, part id, ...
# The hold's bound: the held parts due (read by the caller) are sent, with every other held part
# of their jobs (one bound per job); a job gone or ended leaves nothing to send. Returns the next
# held part's bound (unix seconds), or false when none is held.
RELEASE_HELD_LUA = (
    PARTS_LIB
    + """
for i = 2, #ARGV do redis.call('ZREM', KEYS[1], ARGV[i]) end
for i = 3, #KEYS do release_held(KEYS[i], KEYS[2], KEYS[1], ARGV[1]) end
local nxt = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
return nxt[2] or false
"""
)
