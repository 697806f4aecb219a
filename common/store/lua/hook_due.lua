-- Claim the hooks hashes due by now (common/store/hooks.py due).
-- KEYS: due
-- ARGV: now claim limit
-- Each hash due is claimed until now + claim (s); its message is sent by the caller, and if that
-- message or its worker is lost, the hash is due again at the claim's end. Returns the hashes.
local due = KEYS[1]
local now, claim, limit = ARGV[1], ARGV[2], ARGV[3]

local keys = redis.call('ZRANGEBYSCORE', due, '-inf', now, 'LIMIT', 0, tonumber(limit))
local until_ = tonumber(now) + tonumber(claim)
for _, key in ipairs(keys) do redis.call('ZADD', due, until_, key) end
return keys
