-- luacheck's settings for the store's Lua scripts (common/store/lua/): Redis runs them on Lua 5.1.
std = "lua51"
max_line_length = 120
max_comment_line_length = false  -- a contract line (-- KEYS: / -- ARGV:) is one line
read_globals = {"redis", "cjson", "cmsgpack", "struct", "KEYS", "ARGV"}
-- A `--#include name` line pastes common/store/lua/lib/name.lua in (common/store/scripts.py):
-- its functions read as globals in the files that include it.
files["common/store/lua"] = {
  read_globals = {"hook_event", "part_event", "finish_job", "send_part", "release_held", "take_lease",
                  "redis_now"},
}
-- A piece defines functions for the scripts that include it, not for itself.
files["common/store/lua/lib"] = {ignore = {"211"}}
