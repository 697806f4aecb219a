-- Deliver a delivery again (common/store/hooks.py retry).
-- KEYS: hooks due
-- ARGV: n now
-- Delivery n again, as a new delivery at the end of the object's (same event id and body).
-- Returns the new delivery's number, or 0 when there is no delivery n.
local hooks, due = KEYS[1], KEYS[2]
local n, now = ARGV[1], ARGV[2]

local raw = redis.call('HGET', hooks, 'd' .. n)
if not raw then return 0 end
local old = cjson.decode(raw)
local m = redis.call('HINCRBY', hooks, 'events', 1)
local record = {n = m, id = old.id, type = old.type, created_at = old.created_at, url = old.url,
                status = 'pending', part = old.part, retry_of = tonumber(n)}
redis.call('HSET', hooks, 'd' .. m, cjson.encode(record))
local body = redis.call('HGET', hooks, 'b' .. n)
if body then redis.call('HSET', hooks, 'b' .. m, body) end
redis.call('ZADD', due, 'NX', now, hooks)
return m
