-- bench/lobsters.rb's wrk script: the slowest response and how many took 2 s or more.
-- latency(i) is the i-th smallest distinct latency (us) and its count; #latency how many there are.
done = function(summary, latency, requests)
  local slow = 0
  for i = #latency, 1, -1 do
    local value, count = latency(i)
    if value < 2000000 then break end
    slow = slow + count
  end
  io.write(string.format("lobsters: max_us %d over_2s %d\n", latency.max, slow))
end
