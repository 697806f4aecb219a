-- Renew the leases of the jobs a worker still holds (common/store/sync.py _set_leases).
-- KEYS: running job*
-- ARGV: deadline (id attempt)*
-- One job hash per (id, attempt), in order. Returns the ids it lost (taken over, or expired).
-- A job that ended at the worker's attempt is not lost: that worker wrote its end (a renewal
-- racing the job's last append must not read as a take-over). With a deadline of 0 it lapses
-- them instead (a restarted worker releasing its earlier run's jobs). Fenced like the appends: a
-- worker that was taken over must not keep the new holder's lease alive.
local running = KEYS[1]
local deadline = ARGV[1]

local lost = {}
for i = 2, #KEYS do
  local id, attempt = ARGV[2 * i - 2], ARGV[2 * i - 1]
  if redis.call('HGET', KEYS[i], 'attempt') ~= attempt then
    lost[#lost + 1] = id
  elseif redis.call('HGET', KEYS[i], 'status') == 'running' then
    redis.call('ZADD', running, 'XX', deadline, id)
  end
end
return lost
