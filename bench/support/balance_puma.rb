# Puma configuration of bench/balance.rb: a busy worker waits 5 ms before it
# accepts, so that a less busy one takes the connection first.
wait_for_less_busy_worker 0.005
