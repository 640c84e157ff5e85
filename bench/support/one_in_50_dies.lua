-- wrk script for bench/faults.rb: every 50th request asks for /die (it kills its worker).
local n = 0
request = function()
  n = n + 1
  if n % 50 == 0 then
    return wrk.format("GET", "/die")
  end
  return wrk.format("GET", "/")
end
