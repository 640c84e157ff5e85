-- wrk script for bench/keepalive.rb. Each request carries the time it was
-- written (x-sent, microseconds on CLOCK_MONOTONIC), which the app echoes, so
-- each response's latency is timed as the client saw it: wrk's own
-- distribution adds samples of its own for slow responses (its
-- coordinated-omission correction). Responses are counted by x-pid, the
-- worker that answered. After wrk's report it prints
--   keepalive pid PID COUNT            one line per worker
--   keepalive latency_us P50 P99 MAX
--   keepalive over_2s COUNT
local ffi = require("ffi")
ffi.cdef [[
  typedef struct { long tv_sec; long tv_nsec; } keepalive_timespec;
  int clock_gettime(int clock, keepalive_timespec *time);
]]
local CLOCK_MONOTONIC = 1
local clock = ffi.new("keepalive_timespec")

local function now_us()
  ffi.C.clock_gettime(CLOCK_MONOTONIC, clock)
  return tonumber(clock.tv_sec) * 1000000 + math.floor(tonumber(clock.tv_nsec) / 1000)
end

-- Globals: done reads each thread's copy with thread:get.
counts = {}
latencies = {}
local threads = {}

function setup(thread)
  table.insert(threads, thread)
end

function request()
  return wrk.format(nil, nil, { ["x-sent"] = tostring(now_us()) })
end

local function header(headers, name)
  for key, value in pairs(headers) do
    if string.lower(key) == name then return value end
  end
end

function response(status, headers, body)
  local pid = header(headers, "x-pid") or "none"
  counts[pid] = (counts[pid] or 0) + 1
  local sent = tonumber(header(headers, "x-sent"))
  if sent then table.insert(latencies, now_us() - sent) end
end

function done(summary, latency, requests)
  local total, all = {}, {}
  for _, thread in ipairs(threads) do
    for pid, n in pairs(thread:get("counts")) do total[pid] = (total[pid] or 0) + n end
    for _, us in ipairs(thread:get("latencies")) do table.insert(all, us) end
  end
  for pid, n in pairs(total) do io.write(string.format("keepalive pid %s %d\n", pid, n)) end
  table.sort(all)
  local slow = 0
  for _, us in ipairs(all) do
    if us > 2000000 then slow = slow + 1 end
  end
  local at = function(fraction) return all[math.max(1, math.ceil(fraction * #all))] or 0 end
  io.write(string.format("keepalive latency_us %d %d %d\n", at(0.5), at(0.99), all[#all] or 0))
  io.write(string.format("keepalive over_2s %d\n", slow))
end
