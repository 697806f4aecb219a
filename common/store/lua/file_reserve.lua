-- Room in an owner's file quota for an upload (common/store/files.py reserve_upload).
-- KEYS: owner_bytes owner_expiry owner_files
-- ARGV: now file_id size max_files max_bytes expiry ttl
-- An upload in progress counts as one of the owner's files, of the bytes it has reserved: an
-- entry of owner_bytes (with its ``expiry`` in owner_expiry, so a reservation whose API
-- died is forgotten like an expired file), never listed in owner_files. Its first reservation
-- takes a file (refused when the owner has max_files already, uploads in progress included);
-- each later one raises its bytes to ``size`` (refused past max_bytes with the others' bytes).
-- Concurrent uploads so share the quota: what they reserve is never more than it. file_commit.lua
-- turns the entry into the file's; an upload that fails drops it (FileRecords.abort_upload).
-- The files expired by now (at most 1,000 a call) are forgotten first.
-- Returns {status, files, bytes}: status 1 (reserved), -1 (no file left), -2 (no bytes left);
-- files and bytes: the owner's others (stored files and uploads in progress).
local owner_bytes, owner_expiry, owner_files = unpack(KEYS)
local now, file_id, size, max_files, max_bytes, expiry, ttl = unpack(ARGV, 1, 7)
size, max_files, max_bytes, ttl = tonumber(size), tonumber(max_files), tonumber(max_bytes), tonumber(ttl)

local gone = redis.call('ZRANGEBYSCORE', owner_expiry, '-inf', now, 'LIMIT', 0, 1000)
for _, id in ipairs(gone) do
  redis.call('HDEL', owner_bytes, id)
  redis.call('ZREM', owner_expiry, id)
  redis.call('ZREM', owner_files, id)
end
local mine = redis.call('HGET', owner_bytes, file_id)
local files, total = redis.call('HLEN', owner_bytes), 0
for _, n in ipairs(redis.call('HVALS', owner_bytes)) do total = total + tonumber(n) end
if mine then
  files, total = files - 1, total - tonumber(mine)
elseif files >= max_files then
  return {-1, files, total}
end
if total + size > max_bytes then return {-2, files, total} end
redis.call('HSET', owner_bytes, file_id, size)
if not mine then redis.call('ZADD', owner_expiry, expiry, file_id) end
-- The owner's keys live as long as their longest entry (file_commit.lua); never shortened here.
for _, key in ipairs({owner_bytes, owner_expiry}) do
  if redis.call('TTL', key) < ttl then redis.call('EXPIRE', key, ttl) end
end
return {1, files, total}
