-- hook_event(obj, event, kind, now, part): record the deliveries of an object's event
-- (common/store/hooks.py). obj is the object's hash; event the name its webhook's events filter
-- on; kind the event's type; part the part's index for a part's event (or nil).
-- NOTE: it writes keys named in the object's hash, not in KEYS (as lib/parts.lua does with part_keys).
local RESPONSE_ENDS = {succeeded = 'response.completed', failed = 'response.failed',
                       cancelled = 'response.cancelled', partial = 'response.incomplete'}
local function hook_event(obj, event, kind, now, part)
  local raw = redis.call('HGET', obj, 'hook')
  if not raw then return end
  local hook = cjson.decode(raw)
  if hook.events_of == 'response' and event == 'completed' then
    -- A response's end, as OpenAI names it (api/openai_compat/responses.py's statuses).
    local status, reason = unpack(redis.call('HMGET', obj, 'status', 'finish_reason'))
    kind = RESPONSE_ENDS[status] or kind
    if kind == 'response.completed' and reason == 'length' then kind = 'response.incomplete' end
  end
  local recorded = false
  for _, target in ipairs(hook.targets) do
    for _, e in ipairs(target.events) do
      if e == event then
        local n = redis.call('HINCRBY', hook.key, 'events', 1)
        local record = {n = n, id = 'evt_' .. hook.id .. '_' .. n, type = kind, created_at = tonumber(now),
                        url = target.url, status = 'pending', part = part}
        redis.call('HSET', hook.key, 'd' .. n, cjson.encode(record))
        recorded = true
        break
      end
    end
  end
  if recorded then
    redis.call('HSET', hook.key, 'hook', raw)
    redis.call('EXPIRE', hook.key, hook.ttl)
    redis.call('ZADD', hook.due, 'NX', now, hook.key)
  end
end
