-- Shared by the scripts of jobs with parts. A part's hash is ``Keys.job(part id)``; the job's hash
-- holds ``part_keys``: per part [hash, text, content] (names from common/keys.py). A part's
-- ``summary`` is the data of the event that ended it; the job's ``done`` lists them all.
--#include hook_event

-- part_event(log, chan, data, kind): append an event (kind 'part' unless given) to the job's log.
local function part_event(log, chan, data, kind)
  local seq = redis.call('LLEN', log) + 1
  local entry = '{"seq":' .. seq .. ',"type":"' .. (kind or 'part') .. '","data":' .. data .. '}'
  redis.call('RPUSH', log, entry)
  redis.call('SPUBLISH', chan, entry)
end

-- finish_job(job, log, chan, text, now, ttl): once every part has ended, the job's status from
-- theirs, its done event, and the expiries. Returns false while a part has not ended.
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

-- send_part(key, queued_media, now): send a queued image part's stored message (a prompt_from or
-- held part's: create_parts.lua kept it in its hash), and count it in the queued media zset from now on.
local function send_part(key, queued_media, now)
  local list, message, id = unpack(redis.call('HMGET', key, 'list_key', 'message', 'id'))
  if not message then return end
  redis.call('LPUSH', list, message)
  redis.call('ZADD', queued_media, now, id)
end

-- release_held(job, queued_media, held_media, now): send the messages of the job's held image
-- parts (``held_parts``) still queued: its text parts have their first tokens (part_append.lua),
-- or the hold's bound passed (release_held.lua).
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
