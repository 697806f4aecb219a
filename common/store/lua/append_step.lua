#!lua flags=allow-cross-slot-keys
-- One engine step's writes, for every job in it (several steps' when the writer fell behind)
-- (common/store/calls.py append_step_args).
-- KEYS: (running attempts)[groups] (job log channel text)*
-- ARGV: ttl groups (group attempt first_seq prompt_tokens completion_tokens status finish_reason error id checkpoint text n entry[n])*
-- n >= 1: every append has an entry (an append of none could not tell a retry from a first try).
-- The jobs may lie in several buckets (groups: each bucket's running set and attempts hash,
-- and each job's group, 1-based). One group of KEYS and of ARGV per append. On a Redis Cluster a
-- call's declared keys must share a slot, so a call for the buckets of one master (the flag on
-- the first line lets a script span its slots, Redis 7) declares none and passes the KEYS first
-- in ARGV, after their count (common/store/steps.py). status: the final status ('' if not final);
-- error: JSON ('' for none); checkpoint: '1' or ''; text: the text since the last checkpoint.
-- Returns one answer per append, in order: 1 written, 2 written by an earlier try (a retried
-- call after a dropped connection: a no-op, not a duplicate), 0 fenced (another attempt holds
-- the job), -1 a gap (the log does not end just before the first entry). Appends of one job
-- follow each other in seq order, so each finds the log as the one before it left it.
-- A step costs, per token, RPUSH and SPUBLISH. The fencing is one HMGET of each group's attempts
-- hash for the whole call; a job missing there (its last append is written already) is fenced by its
-- hash's attempt. The text key and the hash's counts are written at a checkpoint only (the
-- writer sends one every few events, with the first and the last): APPEND, then HSET of the
-- counts, text_seq (the log length the text covers) and text_len (its bytes), so a reader takes
-- text_len bytes of the text and the log after text_seq.
-- NOTE: the log's length is checked with RPUSH's answer rather than an LLEN first (one command
-- per token fewer); a push that finds the log elsewhere than expected is undone at once, inside
-- the script, so nobody sees it. A script's writes are refused as a whole (out of memory or a
-- read-only replica refuse its first write), never halfway.
--#include redis_now
--#include hook_event
-- The contract's KEYS[i] is keys[ko + i] and its ARGV[i] is ARGV[o + i]: in the spanning form both
-- lie in ARGV, read at an offset rather than copied out (a copy cost a fifth of the script's time).
local keys, ko, nkeys, o = KEYS, 0, #KEYS, 0
if nkeys == 0 then  -- the keys of several slots, in ARGV
  nkeys = tonumber(ARGV[1])
  keys, ko, o = ARGV, 1, nkeys + 1
end
local ttl, groups = ARGV[o + 1], tonumber(ARGV[o + 2])
local finished_at = redis_now()  -- Redis's clock, not the worker's (a worker's may be off)

-- An append's fields in ARGV, by their offset from its first (``a``, its attempt).
local GROUP, ATTEMPT, FIRST_SEQ, PROMPT_TOKENS, COMPLETION_TOKENS, STATUS, FINISH_REASON, ERROR, ID,
      CHECKPOINT, TEXT, N, ENTRIES = 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12

local function push(log, expected_len, from, to)
  local len = redis.call('RPUSH', log, unpack(ARGV, from, to))
  if len == expected_len then return 1 end
  local before = len - (to - from + 1)
  if before == 0 then redis.call('DEL', log) else redis.call('LTRIM', log, 0, before - 1) end
  if before >= expected_len then return 2 end
  return -1
end

local function append(running, attempts, job, log, channel, text, a, held)
  local n = tonumber(ARGV[a + N])
  if not held then held = redis.call('HGET', job, 'attempt') end
  if held ~= ARGV[a + ATTEMPT] then return 0 end
  local last = tonumber(ARGV[a + FIRST_SEQ]) - 1 + n
  local first_entry, last_entry = a + ENTRIES, a + ENTRIES - 1 + n
  local pushed = push(log, last, first_entry, last_entry)
  if pushed == -1 then return -1 end
  if pushed == 1 then
    for i = first_entry, last_entry do redis.call('SPUBLISH', channel, ARGV[i]) end
  -- Written by an earlier try: the whole append, or its entries only (a call spanning slots
  -- cut short at a key a live resharding had moved). The rest of it is written now.
  elseif tonumber(redis.call('HGET', job, 'text_seq') or 0) >= last then
    return 2
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

-- Each append's first ARGV index, and the ids of each group's appends.
local firsts, ids, a = {}, {}, o + 3
for _ = 2 * groups + 1, nkeys, 4 do
  local g = tonumber(ARGV[a + GROUP])
  firsts[#firsts + 1] = a
  ids[g] = ids[g] or {}
  ids[g][#ids[g] + 1] = ARGV[a + ID]
  a = a + ENTRIES + tonumber(ARGV[a + N])
end
local held = {}
for g, group_ids in pairs(ids) do
  local attempts = redis.call('HMGET', keys[ko + 2 * g], unpack(group_ids))
  for i, id in ipairs(group_ids) do held[id] = attempts[i] end
end
local answers = {}
for j, first in ipairs(firsts) do
  local g, k = tonumber(ARGV[first + GROUP]), ko + 2 * groups + 4 * j - 3
  answers[j] = append(keys[ko + 2 * g - 1], keys[ko + 2 * g], keys[k], keys[k + 1], keys[k + 2], keys[k + 3], first,
                      held[ARGV[first + ID]])
end
return answers
