-- An owner's stored files and their bytes, for its quota (common/store/batches.py usage).
-- KEYS: owner_bytes owner_expiry owner_files
-- ARGV: now
-- The files expired by now (at most 1,000 a call) are forgotten first. Returns {files, bytes}.
local owner_bytes, owner_expiry, owner_files = unpack(KEYS)
local now = ARGV[1]

local gone = redis.call('ZRANGEBYSCORE', owner_expiry, '-inf', now, 'LIMIT', 0, 1000)
for _, id in ipairs(gone) do
  redis.call('HDEL', owner_bytes, id)
  redis.call('ZREM', owner_expiry, id)
  redis.call('ZREM', owner_files, id)
end
local total = 0
for _, n in ipairs(redis.call('HVALS', owner_bytes)) do total = total + tonumber(n) end
return {redis.call('HLEN', owner_bytes), total}
