-- The batches by status, and the lines of those not ended by state, for /metrics, in one call
-- (common/store/batches.py batch_counts).
-- KEYS: batches (batch window)*
-- ARGV: live* '' id*
-- batches: the batches' index; per batch its hash and its window hash. live: the statuses of the
-- batches not ended; then '' and the batch ids, in the order of KEYS.
-- Returns status, count, ..., '', then the lines pending (not fed), in flight (in the window),
-- completed and failed. A batch whose hash expired is skipped, and leaves the index.
local batches = KEYS[1]

local live, ids = {}, 0
for i, status in ipairs(ARGV) do
  if status == '' then ids = i; break end
  live[status] = true
end
local statuses, order = {}, {}
local pending, in_flight, completed, failed = 0, 0, 0, 0
for i = 2, #KEYS, 2 do
  local h = redis.call('HMGET', KEYS[i], 'status', 'total', 'completed', 'failed')
  local status = h[1]
  if not status then redis.call('ZREM', batches, ARGV[ids + i / 2]) end
  if status then
    if not statuses[status] then statuses[status] = 0; order[#order + 1] = status end
    statuses[status] = statuses[status] + 1
    if live[status] then
      local window = redis.call('HLEN', KEYS[i + 1])
      local c, f = tonumber(h[3] or '0'), tonumber(h[4] or '0')
      pending = pending + math.max(tonumber(h[2] or '0') - c - f - window, 0)
      in_flight, completed, failed = in_flight + window, completed + c, failed + f
    end
  end
end
local out = {}
for _, status in ipairs(order) do out[#out + 1] = status; out[#out + 1] = statuses[status] end
out[#out + 1] = ''
out[#out + 1] = pending; out[#out + 1] = in_flight; out[#out + 1] = completed; out[#out + 1] = failed
return out
