-- One engine step's writes, for every job in it (several steps' when the writer fell behind)
-- (common/store/calls.py append_step_args).
-- KEYS: running attempts (job log channel text)*
-- ARGV: ttl finished_at (attempt first_seq prompt_tokens completion_tokens status finish_reason error id checkpoint text n entry[n])*
-- One group of KEYS and of ARGV per append. status: the final status ('' if not final);
-- error: JSON ('' for none); checkpoint: '1' or ''; text: the text since the last checkpoint.
-- Returns one answer per append, in order: 1 written, 2 written by an earlier try (a retried
-- call after a dropped connection: a no-op, not a duplicate), 0 fenced (another attempt holds
-- the job), -1 a gap (the log does not end just before the first entry). Appends of one job
-- follow each other in seq order, so each finds the log as the one before it left it.
-- A step costs, per token, RPUSH and SPUBLISH. The fencing is one HMGET of the attempts hash for
-- the whole call; a job missing there (its last append is written already) is fenced by its
-- hash's attempt. The text key and the hash's counts are written at a checkpoint only (the
-- writer sends one every few events, with the first and the last): APPEND, then HSET of the
-- counts, text_seq (the log length the text covers) and text_len (its bytes), so a reader takes
-- text_len bytes of the text and the log after text_seq.
-- NOTE: the log's length is checked with RPUSH's answer rather than an LLEN first (one command
-- per token fewer); a push that finds the log elsewhere than expected is undone at once, inside
-- the script, so nobody sees it. A script's writes are refused as a whole (out of memory or a
-- read-only replica refuse its first write), never halfway.
--#include hook_event
local running, attempts = KEYS[1], KEYS[2]
local ttl, finished_at = ARGV[1], ARGV[2]

-- An append's fields in ARGV, by their offset from its first (``a``, its attempt).
local ATTEMPT, FIRST_SEQ, PROMPT_TOKENS, COMPLETION_TOKENS, STATUS, FINISH_REASON, ERROR, ID,
      CHECKPOINT, TEXT, N, ENTRIES = 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11

local function push(log, expected_len, from, to)
  local len = redis.call('RPUSH', log, unpack(ARGV, from, to))
  if len == expected_len then return 1 end
  local before = len - (to - from + 1)
  if before == 0 then redis.call('DEL', log) else redis.call('LTRIM', log, 0, before - 1) end
  if before >= expected_len then return 2 end
  return -1
end

local function append(job, log, channel, text, a, held)
  local n = tonumber(ARGV[a + N])
  if not held then held = redis.call('HGET', job, 'attempt') end
  if held ~= ARGV[a + ATTEMPT] then return 0 end
  local last = tonumber(ARGV[a + FIRST_SEQ]) - 1 + n
  local first_entry, last_entry = a + ENTRIES, a + ENTRIES - 1 + n
  if n == 0 then
    if redis.call('LLEN', log) ~= last then return -1 end
  else
    local pushed = push(log, last, first_entry, last_entry)
    if pushed ~= 1 then return pushed end
    for i = first_entry, last_entry do redis.call('SPUBLISH', channel, ARGV[i]) end
  end
  local status = ARGV[a + STATUS]
  local final = status ~= ''
  if ARGV[a + CHECKPOINT] == '' and not final then return 1 end
  local fields = {'prompt_tokens', ARGV[a + PROMPT_TOKENS], 'completion_tokens', ARGV[a + COMPLETION_TOKENS],
                  'text_seq', last, 'text_len', redis.call('APPEND', text, ARGV[a + TEXT])}
  if final then
    for _, v in ipairs({'status', status, 'finish_reason', ARGV[a + FINISH_REASON], 'finished_at', finished_at,
                        'error', ARGV[a + ERROR]}) do fields[#fields + 1] = v end
  end
  redis.call('HSET', job, unpack(fields))
  if final then
    redis.call('ZREM', running, ARGV[a + ID])
    redis.call('HDEL', attempts, ARGV[a + ID])
    redis.call('EXPIRE', job, ttl)
    redis.call('EXPIRE', log, ttl)
    redis.call('EXPIRE', text, ttl)
    hook_event(job, 'completed', 'job.completed', finished_at)
  end
  return 1
end

local ids, a = {}, 3
for _ = 3, #KEYS, 4 do
  ids[#ids + 1] = ARGV[a + ID]
  a = a + ENTRIES + tonumber(ARGV[a + N])
end
if #ids == 0 then return {} end
local held = redis.call('HMGET', attempts, unpack(ids))
local answers = {}
a = 3
for k = 3, #KEYS, 4 do
  answers[#answers + 1] = append(KEYS[k], KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], a, held[#answers + 1])
  a = a + ENTRIES + tonumber(ARGV[a + N])
end
return answers
