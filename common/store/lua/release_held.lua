-- Send the held image parts whose hold's bound passed (common/store/sync.py release_held).
-- KEYS: held_media queued_media job*
-- ARGV: now part_id*
-- The held parts due (read by the caller) are sent, with every other held part of their jobs (one
-- bound per job); a job gone or ended leaves nothing to send. Returns the next held part's bound
-- (unix seconds), or false when none is held.
--#include parts
local held_media, queued_media = KEYS[1], KEYS[2]
local now = ARGV[1]

for i = 2, #ARGV do redis.call('ZREM', held_media, ARGV[i]) end
for i = 3, #KEYS do release_held(KEYS[i], queued_media, held_media, now) end
local nxt = redis.call('ZRANGE', held_media, 0, 0, 'WITHSCORES')
return nxt[2] or false
