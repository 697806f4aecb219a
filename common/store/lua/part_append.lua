-- A part's writes for one engine step (common/store/calls.py part_append_args).
-- KEYS: part log channel running part_text job text content queued_media held_media
-- ARGV: attempt first_seq prompt_tokens completion_tokens status finish_reason error ttl id entries_text summary content index entry*
-- log, channel, job, text: the job's; part_text, content, id, index: the part's. first_seq: the
-- part's own count of events; status: the final status ('' if not final); error: JSON ('' for
-- none); summary: the last entry's data (JSON, when final); content: '' for none.
-- append_step.lua for a part: fenced by the part's attempt and idempotent by its own event count
-- (``logged``); each entry gets the job log's next seq. A text part's first append (its first
-- token, or its end) counts toward sending its job's held image parts. The part's last append
-- stores its summary and content, starts or fails the parts that take their prompt from it, and
-- ends the job when no part is left. Returns 1 written, 2 written before, 0 fenced or -1 a gap.
--#include redis_now
--#include parts
local part, log, channel, running, part_text, job, text, content_key, queued_media, held_media = unpack(KEYS)
local attempt, first_seq, prompt_tokens, completion_tokens, status, finish_reason, error_json, ttl, id,
      entries_text, summary, content, index = unpack(ARGV, 1, 13)
local ENTRIES = 14
local now = redis_now()  -- finished_at and the events' times: Redis's clock, not the worker's

if redis.call('HGET', part, 'attempt') ~= attempt then return 0 end
local n = #ARGV - ENTRIES + 1
local logged = tonumber(redis.call('HGET', part, 'logged') or '0')
local first = tonumber(first_seq)
if logged >= first - 1 + n and n > 0 then return 2 end
if logged ~= first - 1 then return -1 end
for i = ENTRIES, #ARGV do
  local seq = redis.call('LLEN', log) + 1
  local entry = (string.gsub(ARGV[i], '^{"seq":%d+,', '{"seq":' .. seq .. ',', 1))
  redis.call('RPUSH', log, entry)
  redis.call('SPUBLISH', channel, entry)
end
redis.call('HSET', part, 'logged', logged + n, 'prompt_tokens', prompt_tokens, 'completion_tokens', completion_tokens)
if logged == 0 and n > 0 and redis.call('HGET', part, 'holds') == '1'
   and redis.call('HINCRBY', job, 'text_waiting', -1) <= 0 then
  release_held(job, queued_media, held_media, now)
end
if entries_text ~= '' then
  redis.call('APPEND', part_text, entries_text)
  redis.call('APPEND', text, entries_text)
end
if status == '' then return 1 end
redis.call('HSET', part, 'status', status, 'finish_reason', finish_reason, 'finished_at', now,
           'error', error_json, 'summary', summary)
hook_event(job, 'part', 'job.part', now, tonumber(index))
redis.call('ZREM', running, id)
if content ~= '' then redis.call('SET', content_key, content, 'EX', ttl) end
local deps = redis.call('HGET', part, 'dependents')
if deps then
  local pk = cjson.decode(redis.call('HGET', job, 'part_keys'))
  for _, d in ipairs(cjson.decode(deps)) do
    local key = pk[d + 1][1]
    if redis.call('HGET', key, 'status') == 'queued' then
      if status == 'succeeded' then
        send_part(key, queued_media, now)
      else
        local err = '{"message":"part ' .. index .. ', which this part takes its prompt from, ' ..
                    status .. '","type":"dependency_failed"}'
        local failed = '{"part":' .. d .. ',"status":"failed","error":' .. err .. '}'
        redis.call('HSET', key, 'status', 'failed', 'finish_reason', 'error', 'finished_at', now,
                   'error', err, 'summary', failed)
        part_event(log, channel, failed)
        hook_event(job, 'part', 'job.part', now, d)
      end
    end
  end
end
finish_job(job, log, channel, text, now, ttl)
return 1
