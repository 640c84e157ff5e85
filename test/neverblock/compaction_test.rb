# frozen_string_literal: true

require "test_helper"

# Heap compaction with every C extension on NeverBlock's paths in use.
#
# Compaction (GC.compact, GC.auto_compact, and Process.warmup, which
# `neverblock serve` and the refork mold call at boot on Ruby 3.3+) moves
# objects and updates the references the garbage collector knows of. A C
# extension that keeps a bare reference to a Ruby object, unmarked or marked
# without being updated, reads freed or foreign memory after the next
# compaction: llhttp did (lib/neverblock/llhttp_pin.rb,
# test/neverblock/llhttp_pin_test.rb). This test looks for the same class of
# bug in everything else the library runs through: io-event's selector (the
# loops of the clients and of three servers, their timers, a deferred block,
# a child process), pg (pooled and pipelined, a cancelled query), mysql2 and
# trilogy (a killed query), NeverBlock's own http_head (the servers' C head
# parser) and epoll (idle keep-alive connections parked there),
# redis-client (RedisSemaphore, the Debouncer's RedisStore), llhttp (the
# other server and the reverse proxy, good and refused messages) — over real
# sockets.
#
# It runs test/fixtures/compaction_child.rb in a child Ruby, which compacts
# the heap (moving every object that can move) twice in each of three rounds:
# once with work suspended in every component, once in the middle of a burst
# of fresh work, and checks every answer. A crash is the child dying of a
# signal; a wrong answer fails it; a hang ends it after 40 s with every
# thread's backtrace.
class CompactionTest < PlainTest
  include NeverBlockTest::Databases

  CHILD = File.expand_path("../fixtures/compaction_child.rb", __dir__)
  ROUNDS = 3

  # What each round of the child does and checks, by the label of each
  # check: the child prints their tally over the rounds.
  PER_ROUND = {
    # Databases: what step 1 holds across the compaction + what the burst of step 2 sends.
    "pg" => 2 + 6,
    "pg cancelled" => 1, # a timeout cancels its pg_sleep(10) on the server
    "pg transaction" => 1,
    "pg pipelined" => 6 + 20, # a slow statement and five behind it in the pipeline
    "pg pipelined error" => 1 + 1,
    "mysql2" => 2 + 4,
    "mysql2 killed" => 1, # a timeout kills its SLEEP(10) on the server
    "trilogy" => 2 + 4,
    "trilogy killed" => 1,
    "redis semaphore" => 3 + 4, # two holders and a waiter, then four
    # The scheduler.
    "sleep" => 1,
    "timeout" => 1 + 1,
    "queue" => 1,
    "queue push" => 1,
    "defer" => 1,
    "process" => 1,
    # Each of the two servers (C head parser, llhttp): one request in the app
    # across the compaction, then the burst's.
    "http slow" => 2,
    "http db" => 2 + 2,
    "http hello" => 2 * 3,
    "http echo" => 2,
    "http echo chunked" => 2,
    "http stream" => 2,
    "http sem" => 2,
    "net/http keep-alive" => 2,
    "fast keep-alive reused" => 3, # parked in the IdleSet across the compaction, then two pipelined requests each
    "llhttp keep-alive reused" => 3,
    "refused content-length abc" => 2,
    "refused content-length over max_body" => 2,
    "refused chunked over max_body" => 2,
    "refused bad chunk size" => 2,
    "refused garbage request line" => 2,
    "refused bad header" => 2,
    # The front server (Debouncer on a RedisStore, ReverseProxy to the llhttp server).
    "proxy herd" => 4, # across the compaction: a leader upstream, the others waiting for it
    "proxy echo" => 1,
    "proxy hello" => 2,
    "proxy db" => 1,
    "proxy stream" => 1,
    "proxy echo chunked" => 1,
    "proxy bad upstream" => 2, # an upstream response llhttp refuses: 502
    "proxy BadResponse logged" => 2, # (so the 502 is llhttp's error, not a broken connection)
    "refused by the proxy" => 1
  }.freeze

  def setup
    skip "this Ruby cannot compact its heap" unless GC.respond_to?(:verify_compaction_references)
    # The child needs them all: without one, the test fails saying how to start it.
    pg_conninfo
    mysql_config
    redis_url
  end

  def test_every_c_extension_on_our_paths_survives_compactions_while_in_use
    out, err, status = ruby_child(CHILD, env: { "NB_ROUNDS" => ROUNDS.to_s, "NB_DEADLINE" => "40" }, timeout: 60)
    how = status.signaled? ? "was killed by SIG#{Signal.signame(status.termsig)}" : "exited with #{status.exitstatus}"
    assert status.success?, "the child #{how}:\n#{err.lines.first(60).join}"
    expected = "#{ROUNDS} rounds: #{PER_ROUND.sort.map { |label, n| "#{label} #{n * ROUNDS}" }.join(', ')}"
    assert_equal expected, out.strip
  end
end
