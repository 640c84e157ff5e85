# frozen_string_literal: true

# The benchmark app's GET /fast called in this process, with no HTTP server:
# the Rails and ActiveRecord work (and the query's client side) that any
# server adds its own to. bench/rails.rb runs it beside the servers of part
# (c), under the same Ruby, with neverblock_postgresql (NB_RAILS_ADAPTER).
#
#   ruby bench/rails/alone.rb REQUESTS CONCURRENCY
#
# CONCURRENCY NeverBlock tasks share REQUESTS calls of the app, as a
# NeverBlock server's requests would, with a pool connection each opened
# first and the heap warmed up as `neverblock serve` does; each request's
# Rack env is a copy of one made before (a Hash#dup: far less than a
# server's parse), its body iterated and closed. Prints one line: "seconds
# cpu_us allocations gc_us", per request (CPU: this process's, as /proc
# counts a server's).

require_relative "app"
require "rack/mock"

requests = Integer(ARGV.fetch(0))
concurrency = Integer(ARGV.fetch(1))
app = Rails.application
# As `neverblock serve` does once the app is loaded (Ruby 3.3+).
Process.warmup if Process.respond_to?(:warmup)

TEMPLATE = Rack::MockRequest.env_for("/fast").tap { |env| env.delete("rack.input") }.freeze # a GET: no body
call = lambda do
  status, _headers, body = app.call(TEMPLATE.dup)
  body.each { |_chunk| nil } # as a server writes it
  body.close if body.respond_to?(:close)
  raise "GET /fast answered #{status}" unless status == 200
end

# `count` calls from `concurrency` tasks, each taking the next while any
# is left (as the benchmark's clients do).
# @return [Array(Float, Float, Integer, Integer)] wall and CPU seconds, objects allocated, GC ms
run = lambda do |count|
  allocated, gc_ms = GC.stat(:total_allocated_objects), GC.stat(:time) # rubocop:disable Style/ParallelAssignment
  cpu = Process.clock_gettime(Process::CLOCK_PROCESS_CPUTIME_ID)
  wall = Process.clock_gettime(Process::CLOCK_MONOTONIC)
  left = count
  NeverBlock.run(stall_threshold: nil) do
    NeverBlock.wait_all(Array.new([concurrency, count].min) do
      NeverBlock.spawn do
        while left.positive?
          left -= 1
          call.call
        end
      end
    end)
  end
  [Process.clock_gettime(Process::CLOCK_MONOTONIC) - wall, Process.clock_gettime(Process::CLOCK_PROCESS_CPUTIME_ID) - cpu,
   GC.stat(:total_allocated_objects) - allocated, GC.stat(:time) - gc_ms]
end

# Warm-up: a pool connection per task opened (each costs milliseconds of
# SCRAM; each task holds its own until all have one), the code paths run
# and compiled.
NeverBlock.run do
  holding = 0
  NeverBlock.wait_all(Array.new(concurrency) do
    NeverBlock.spawn do
      ActiveRecord::Base.with_connection do |conn|
        conn.select_value("select 1")
        holding += 1
        sleep 0.01 until holding == concurrency
      end
    end
  end)
end
run.call([concurrency * 2, 400].max)
seconds, cpu, allocated, gc_ms = run.call(requests)
puts format("%.6f %.3f %.2f %.3f", seconds, cpu / requests * 1e6, allocated.fdiv(requests), gc_ms * 1000.0 / requests)
