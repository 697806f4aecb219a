-- redis_now(): Redis's clock in seconds (common/store/watchers.py: every score is on it).
local function redis_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1e6
end
