-- An upload's lines become a file (common/store/files.py _commit).
-- KEYS: feeder upload lines file owner_files owner_bytes owner_expiry artifacts
-- ARGV: holder count ttl created_at file_id size artifact (field value)*
-- holder: ``token:fence``, '' for an upload (which takes no lease); count: the file's lines;
-- artifact: the name of the file's artifact, sealed already (common/artifacts.py), '' when its
-- lines are in Redis. The upload's lines become the file, with its object, at once, if the fence
-- holds (-1) and the upload holds exactly ``count`` lines (-2): a file is listed only whole. An
-- artifact is deleted when the file expires (``artifacts``' score). Writing the same file again (a
-- batch's results assembled twice) replaces it. Returns 1 when written.
local feeder, upload, lines, file, owner_files, owner_bytes, owner_expiry, artifacts = unpack(KEYS)
local holder, count, ttl, created_at, file_id, size, artifact = unpack(ARGV, 1, 7)
local expires_at = tonumber(created_at) + tonumber(ttl)

if holder ~= '' and redis.call('GET', feeder) ~= holder then return -1 end
if artifact ~= '' then
  redis.call('ZADD', artifacts, expires_at, artifact)
else
  if redis.call('LLEN', upload) ~= tonumber(count) then return -2 end
  redis.call('DEL', lines)
  if redis.call('EXISTS', upload) == 1 then
    redis.call('RENAME', upload, lines)
    redis.call('EXPIRE', lines, ttl)
  end
end
redis.call('DEL', file)
redis.call('HSET', file, unpack(ARGV, 8))
redis.call('EXPIRE', file, ttl)
redis.call('ZADD', owner_files, created_at, file_id)
redis.call('HSET', owner_bytes, file_id, size)
redis.call('ZADD', owner_expiry, expires_at, file_id)
for _, key in ipairs({owner_files, owner_bytes, owner_expiry}) do redis.call('EXPIRE', key, ttl) end
return 1
