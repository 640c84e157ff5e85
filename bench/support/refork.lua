-- bench/refork.rb's warm-up: wrk (-t1) stops after NB_REFORK_REQUESTS responses.
-- wrk's main thread sleeps for all of -d whatever its threads do, so the
-- script interrupts wrk as Ctrl-C would (SIGINT), and wrk reports at once.
local ffi = require("ffi")
ffi.cdef [[
  int getpid(void);
  int kill(int pid, int signal);
]]
local SIGINT = 2
local wanted = tonumber(os.getenv("NB_REFORK_REQUESTS"))
local seen = 0

function response()
  seen = seen + 1
  if seen == wanted then
    wrk.thread:stop()
    ffi.C.kill(ffi.C.getpid(), SIGINT)
  end
end
