-- Create a job with parts (common/store/calls.py create_parts_call).
-- KEYS: queued job owner_jobs owner_queued idem?
-- ARGV: max_queued max_owner_queued id now idem_ttl fields parts index_age index_max
-- fields: the job's fields (JSON object); parts: JSON array of {id, key, fields, zset, score,
-- push, list, message}; idem: the idempotency key (with an idem_ttl, '' for none).
-- create.lua for a job with parts: the job and every part's hash, and the messages of the parts
-- that can start now (a part with prompt_from keeps its message until its text part succeeded, a
-- held one until its job's text parts have their first tokens: lib/parts.lua's release_held).
-- Text parts are queued jobs (backpressure, the sweep's lost messages); an image part whose
-- message is sent goes into the queued media zset (the sweep's lost messages only), a held one
-- into the held media zset (scored with the latest it is sent); the job itself never is queued.
-- max_owner_queued bounds the owner's queued jobs as in create.lua (its text parts count).
-- Returns 1 (created), 0 (queue full), -1 (the owner's share full) or the id of the job the
-- idempotency key names.
local queued, job, owner_jobs, owner_queued = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local max_queued, max_owner_queued, id, now, idem_ttl, fields, parts, index_age, index_max = unpack(ARGV, 1, 9)
local idem = idem_ttl ~= '' and KEYS[5]

if idem then
  local earlier = redis.call('GET', idem)
  if earlier then return earlier end
end
if redis.call('ZCARD', queued) >= tonumber(max_queued) then return 0 end
if max_owner_queued ~= '' and redis.call('ZCARD', owner_queued) >= tonumber(max_owner_queued) then
  for _, q in ipairs(redis.call('ZRANGE', owner_queued, 0, -1)) do
    if not redis.call('ZSCORE', queued, q) then redis.call('ZREM', owner_queued, q) end
  end
  if redis.call('ZCARD', owner_queued) >= tonumber(max_owner_queued) then return -1 end
end
local function hset(key, values)
  local flat = {}
  for k, v in pairs(values) do flat[#flat + 1] = k; flat[#flat + 1] = v end
  redis.call('HSET', key, unpack(flat))
end
hset(job, cjson.decode(fields))
for _, p in ipairs(cjson.decode(parts)) do
  hset(p.key, p.fields)
  if p.zset ~= '' then redis.call('ZADD', p.zset, p.score, p.id) end
  if p.zset == queued and max_owner_queued ~= '' then
    redis.call('ZADD', owner_queued, now, p.id)
    redis.call('EXPIRE', owner_queued, index_age)
  end
  if p.push then redis.call('LPUSH', p.list, p.message) end
end
redis.call('ZADD', owner_jobs, now, id)
redis.call('ZREMRANGEBYSCORE', owner_jobs, '-inf', '(' .. (tonumber(now) - tonumber(index_age)))
redis.call('ZREMRANGEBYRANK', owner_jobs, 0, -tonumber(index_max) - 1)
redis.call('EXPIRE', owner_jobs, index_age)
if idem then redis.call('SET', idem, id, 'EX', idem_ttl) end
return 1
